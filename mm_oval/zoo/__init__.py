"""The bundled tiny LLaVA: vocabulary, tokenizer/processor, model builder, data generator, trainer."""
