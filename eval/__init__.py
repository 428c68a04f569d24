"""Evaluation harness: MMBench CircularEval, VQA accuracy, POPE; imported as mm_oval.eval."""
