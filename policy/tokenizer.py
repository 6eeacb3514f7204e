"""A small byte-level BPE tokenizer with Qwen's pre-tokenizer, special tokens and chat template.

Trained locally (no model hub) on a synthetic corpus that covers the vocabulary of Parallax's
tasks: digits, colour and shape words, geometry words, LaTeX bits, `<think>`/`</think>`,
`\\boxed{}` and the instruction text. The result is a transformers `Qwen2Tokenizer` that
round-trips any text exactly (byte-level) and renders Qwen2.5-VL chat prompts.
"""

from __future__ import annotations

import json
import random

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]
"""Qwen2.5's 22 added tokens, in Qwen's order, with whether each is a special token."""

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-VL-Instruct's chat template."""

COLOURS = [
    "red",
    "green",
    "blue",
    "yellow",
    "purple",
    "orange",
    "black",
    "white",
    "gray",
    "pink",
    "brown",
    "cyan",
]
SHAPES = [
    "circle",
    "square",
    "triangle",
    "star",
    "rectangle",
    "diamond",
    "shape",
    "shapes",
    "circles",
    "squares",
    "triangles",
]
WORDS = (
    "what is the colour color of the how many are there in image picture which one is bigger smaller larger "
    "left right top bottom count number answer find angle measure length side area perimeter radius "
    "diameter line segment point triangle circle chord arc tangent parallel perpendicular degrees units "
    "given that if then so therefore we have let x y z AB BC CA the value of solve for and or is "
    "You are a helpful assistant. You FIRST think about the reasoning process as an internal monologue "
    "and then provide the final answer. The reasoning process MUST BE enclosed within <think> </think> "
    "tags. The final answer MUST BE put in \\boxed{}. look see"
).split()
LATEX = [
    "\\frac{",
    "\\sqrt{",
    "\\pi",
    "^\\circ",
    "\\boxed{",
    "\\times",
    "\\cdot",
    "\\angle",
    "\\triangle",
    "\\text{",
    "}",
    "{",
    "(",
    ")",
    "=",
    "+",
    "-",
    "*",
    "/",
    "^",
    ".",
    ",",
    ":",
    "?",
    "$",
]


def training_corpus(seed: int, lines: int = 3000) -> list[str]:
    """Deterministic synthetic text covering the tasks' vocabulary."""
    rng = random.Random(seed)
    out: list[str] = []
    vocab = COLOURS + SHAPES + WORDS
    for i in range(lines):
        words = [rng.choice(vocab) for _ in range(rng.randint(4, 14))]
        number = (
            str(rng.randint(0, 1000)) if rng.random() < 0.7 else f"{rng.randint(1, 99)}.{rng.randint(0, 9)}"
        )
        latex = "".join(rng.choice(LATEX) for _ in range(rng.randint(0, 3)))
        thought = " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 6)))
        answer = rng.choice(
            [
                number,
                rng.choice(COLOURS),
                rng.choice(SHAPES),
                rng.choice(["left", "right"]),
                f"\\frac{{{number}}}{{2}}",
            ]
        )
        if i % 2 == 0:
            out.append(f"{' '.join(words).capitalize()} {number}{latex}?")
        out.append(f"<think> {thought} </think> \\boxed{{{answer}}}")
        out.append(f"<think>{thought}</think>\n\\boxed{{{answer}}}")
    out.append(" ".join(str(d) for d in range(10)) + " " + "".join(str(d) for d in range(10)))
    return out


def train_bpe(vocab_size: int, seed: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE model with Qwen's pre-tokenization; returns (vocab, merges)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    return dict(model["vocab"]), merges


def build_tokenizer(vocab_size: int, seed: int):
    """Return a `Qwen2Tokenizer` with a locally trained BPE vocabulary and Qwen's 22 added tokens.

    `vocab_size` counts the BPE vocabulary; the added tokens take the ids right after it.
    """
    vocab, merges = train_bpe(vocab_size - len(SPECIAL_TOKENS), seed)
    base = len(vocab)
    for i, (token, _) in enumerate(SPECIAL_TOKENS):
        vocab[token] = base + i
    return _qwen_tokenizer(vocab, merges)


def build_full_vocab_tokenizer(vocab_size: int, seed: int = 0, special_base: int = 151643):
    """A `Qwen2Tokenizer` whose ids cover 0..vocab_size-1, Qwen's added tokens at Qwen's ids (151643..).

    For random-weight models of the published shapes: they sample any id, so every id must decode.
    The locally trained BPE vocabulary comes first, then filler tokens no merge produces (they decode
    to text), then the 22 added tokens at `special_base`, then filler up to `vocab_size`.
    """
    vocab, merges = train_bpe(2000, seed=seed)
    i = 0
    while len(vocab) < special_base:
        token = f"w{i}"
        if token not in vocab:
            vocab[token] = len(vocab)
        i += 1
    for k, (token, _) in enumerate(SPECIAL_TOKENS):
        vocab[token] = special_base + k
    while len(vocab) < vocab_size:
        vocab[f"x{len(vocab)}"] = len(vocab)
    return _qwen_tokenizer(vocab, merges)


def _qwen_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """The `Qwen2Tokenizer` of a byte-level BPE whose vocabulary holds Qwen's 22 added tokens, registered
    as added tokens (the special ones as special), with Qwen's chat template."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=32768,
    )

    tokenizer.add_tokens(
        [AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS if not s], special_tokens=False
    )
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                t for t, s in SPECIAL_TOKENS if s and t not in ("<|endoftext|>", "<|im_end|>")
            ]
        }
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
