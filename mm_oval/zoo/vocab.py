"""The word-level vocabulary of the bundled tiny LLaVA. Every word the scene generator and the
evaluation prompts can produce is listed here, so the tokenizer never needs <unk> on bundled data."""

SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "<image>"]

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "pink"]
SHAPES = ["circle", "square", "triangle", "cross"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
DIGITS = [str(i) for i in range(0, 65)]

_PROMPT_WORDS = """
USER ASSISTANT SYSTEM : ? . , ' ! ( ) - \" /
what which who where how many much is are there the a an of in on at to color colour shape object objects
row column left right above below next any yes no answer with option s letter from given choices directly
question using single word or phrase hint note image picture scene only count number same as than
A B C D E this that it its does do has have contain contains kind and not
Answer
""".split()


def vocabulary() -> list[str]:
    """Special tokens first (fixed ids), then every word, without duplicates, in a stable order."""
    words: list[str] = []
    for w in [*SPECIAL_TOKENS, *COLORS, *SHAPES, *NUMBER_WORDS, *DIGITS, *_PROMPT_WORDS]:
        if w not in words:
            words.append(w)
    return words


# the 576-token benchmark's extra words (relations, the object list); appended, so every word of the
# 64-token vocabulary keeps its id
_WORDS_576 = """
nearest top bottom list List each by separated commas
""".split()


def vocabulary576() -> list[str]:
    """The 64-token vocabulary, then the words the 576-token benchmark adds."""
    words = vocabulary()
    return words + [w for w in _WORDS_576 if w not in words]
