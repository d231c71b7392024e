"""Offline tokenizers for the zoo: a BPE trained locally on a built-in corpus.

No tokenizer can be downloaded at run time, so each zoo checkpoint gets a small BPE trained
here, in the style of its architecture (byte-level BPE for Qwen, a Llama-style BPE with a
"▁" word marker and byte fallback for LLaVA), with the architecture's special tokens inside
the vocabulary and its chat template. Training is deterministic: the same corpus gives the
same vocabulary and merges on every machine.
"""

from __future__ import annotations

from collections import Counter
from itertools import product

from tokenizers import Regex, pre_tokenizers

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
LLAVA_BASE_TOKENS = ("<unk>", "<s>", "</s>")
LLAVA_ADDED_TOKENS = ("<image>", "<pad>")  # appended after the BPE vocabulary, as in llava-1.5-hf

# The split Qwen2 uses before byte-level BPE (contractions, letters, single digits, ...).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2-VL's conversation format: a default system turn, <|im_start|>role ... <|im_end|>, and
# each image or video as a vision span the processor expands to one pad token per patch group.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# LLaVA-1.5's format: "USER: <image>\n<prompt> ASSISTANT:"; the tokenizer adds <s>.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] if message['content'] is string "
    "else message['content'][0]['text'] }} "
    "{% else %}{{ 'USER: ' if message['role'] == 'user' else 'ASSISTANT: ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}</s>{% endif %} {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

_OBJECTS = ["car", "bus", "truck", "person", "bicycle", "motorcycle", "dog", "cat", "tree", "road",
            "sign", "light", "lane", "street", "vehicle", "object", "camera", "frame", "image", "video"]
_COLORS = ["red", "green", "blue", "yellow", "white", "black", "grey", "orange", "purple", "brown"]
_DIRECTIONS = ["left", "right", "up", "down", "stationary", "moving", "parked", "crossing"]
_TEMPLATES = [
    "How many {o}s are there in the image?",
    "Is there a {c} {o} in the frame?",
    "What color is the {o}?",
    "Which way is the {c} {o} moving? It is moving {d}.",
    "A {c} {o} is moving {d} along the road.",
    "Find the {c} {o} and give its box.",
    "The answer is yes. The answer is no. There are {n} {o}s.",
    "Describe the image. A street with {n} {c} {o}s.",
    "Detect every {o} and report the boxes as (x1, y1), (x2, y2).",
]
_PROSE = (
    "You are a helpful assistant. The user asks a question about an image or a video and the "
    "assistant answers it with a short, exact reply. Count the objects, name their colors, tell "
    "which way they move, and describe the scene in one sentence. A camera watches a busy street "
    "where cars, buses, trucks, bicycles and people pass by during the day and at night. "
    "What is happening in this video? Please answer the question. Thank you. "
    "USER: ASSISTANT: system user assistant"
)


def builtin_corpus() -> list[str]:
    """A small, fixed corpus: vision prompts, answers, numbers and everyday English."""
    lines = [_PROSE] * 4
    for template, (o, c, d) in product(_TEMPLATES, product(_OBJECTS, _COLORS, _DIRECTIONS[:3])):
        lines.append(template.format(o=o, c=c, d=d, n=(len(o) + len(c)) % 10))
    lines += [" ".join(str(n) for n in range(start, start + 50)) for start in range(0, 1000, 50)]
    return lines


def _train(pre_tokenizer, vocab_size: int, initial_alphabet: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Trains BPE on the built-in corpus; returns (tokens in id order, merges in rank order).

    A plain greedy BPE rather than the `tokenizers` trainer: that one breaks ties between equally
    frequent pairs in hash-map order, which differs between processes, and the zoo must give
    the same bytes on every run. Ties here go to the lexicographically smallest pair.
    """
    words: Counter[tuple[str, ...]] = Counter()
    for line in builtin_corpus():
        for piece, _ in pre_tokenizer.pre_tokenize_str(line):
            words[tuple(piece)] += 1
    alphabet = sorted(set(initial_alphabet) | {ch for word in words for ch in word})
    tokens, merges = list(alphabet), []
    while len(tokens) < vocab_size:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:  # a pair seen once is not worth a token
            break
        merges.append(best)
        tokens.append(best[0] + best[1])
        words = Counter({_merge(word, best): n for word, n in words.items()})
    return tokens, merges


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def build_qwen_tokenizer(vocab_size: int):
    """Qwen2-style tokenizer: special tokens at ids 0..13, then the byte-level BPE vocabulary."""
    from transformers import Qwen2Tokenizer

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokens, merges = _train(pre, vocab_size - len(QWEN_SPECIAL_TOKENS), pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(list(QWEN_SPECIAL_TOKENS) + tokens)}
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"},
    )
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


def build_llava_tokenizer(vocab_size: int):
    """Llama-style tokenizer: <unk> <s> </s>, 256 byte-fallback tokens, BPE, then <image> <pad>."""
    from transformers import LlamaTokenizer

    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    n_fixed = len(LLAVA_BASE_TOKENS) + len(byte_tokens) + len(LLAVA_ADDED_TOKENS)
    tokens, merges = _train(pre, vocab_size - n_fixed, [])
    vocab = {t: i for i, t in enumerate(list(LLAVA_BASE_TOKENS) + byte_tokens + tokens)}
    tok = LlamaTokenizer(vocab=vocab, merges=merges, pad_token="<pad>", add_bos_token=True,
                         extra_special_tokens={"image_token": "<image>"})
    tok.add_special_tokens({"additional_special_tokens": ["<image>"], "pad_token": "<pad>"})
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    return tok
