"""Train the tiny model's byte-level BPE tokenizer locally and wrap it for transformers."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from furlong.model.template import CHAT_TEMPLATE

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# Control tokens: skipped by decode(skip_special_tokens=True).
CONTROL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
# Markup the model writes itself; single tokens, but kept in decoded text (as Qwen does) so tool calls and
# reasoning survive decode(skip_special_tokens=True).
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A GPT-2-style byte-level BPE: every byte is in the base alphabet, so any text round-trips."""
    tok = Tokenizer(models.BPE())
    # use_regex=True is GPT-2's split (letters / digits / punctuation / whitespace runs).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),  # markup tokens are appended after training
        min_frequency=2,
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def wrap_for_transformers(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer the tiny checkpoint ships: ChatML template, <|im_end|> ends a turn."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,  # would rewrite " ." etc. on decode and break round-trips
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
