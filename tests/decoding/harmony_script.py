"""A harmony model whose output is known: a one-layer Llama GGUF with the ``harmony`` test vocabulary
(``tests/decoding/runtime/gguf_vocabs.py``) and weights set by hand, so that greedy, after any prompt ending in the
template's ``<|start|>assistant``, it writes ``OUTPUT``: an analysis message, then a final one.

How: each scripted token has a one-hot embedding and the output layer maps it to its successor, which makes a
bigram model. ``<|channel|>`` and ``<|message|>`` have two successors each (analysis / final, the reasoning / the
answer): the first reasoning token, `` xylograph`` (a token no merge reaches, so never in a prompt), is the flag.
The attention's one head finds it wherever it is (a key only it has, on the rotary pair that barely turns), the
MLP ANDs "the flag was seen" with the current token (SiLU(flag) x current: zero unless both are there), and that
product moves ``<|channel|>`` to ``final`` and ``<|message|>`` to the answer. A token off the script has no successor:
every logit 0, so token 0 (``<|endoftext|>``, which ends a generation) wins.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.runtime.gguf.tokenizer import read_vocab
from tests.decoding.runtime.gguf_vocabs import add_vocab, write_vocab

REASONING = ("\u0120xylograph", "\u0120records", "\u0120say", "\u0120when")
ANSWER = ("It", "\u0120was", "\u0120built", "\u0120in", "\u0120Paris", ".")
REASONING_TEXT = " xylograph records say when"
ANSWER_TEXT = "It was built in Paris."
OUTPUT = (f"<|channel|>analysis<|message|>{REASONING_TEXT}<|end|><|start|>assistant<|channel|>final<|message|>"
          f"{ANSWER_TEXT}<|return|>")
# OUTPUT's tokens (the flag is one token, which tokenizing OUTPUT would split)
OUTPUT_TOKENS = ("<|channel|>", "analysis", "<|message|>", *REASONING, "<|end|>", "<|start|>", "ass", "istant",
                 "<|channel|>", "final", "<|message|>", *ANSWER, "<|return|>")
_MARKUP = ("ass", "istant", "<|channel|>", "analysis", "final", "<|message|>", "<|end|>", "<|start|>", "<|return|>")
_NEXT = {"istant": "<|channel|>", "analysis": "<|message|>", "final": "<|message|>", "<|end|>": "<|start|>",
         "<|start|>": "ass", "ass": "istant",
         **dict(zip(REASONING, (*REASONING[1:], "<|end|>"), strict=True)),
         **dict(zip(ANSWER, (*ANSWER[1:], "<|return|>"), strict=True))}
# where "the flag was seen" changes the successor: current token -> (without, with)
_SWITCH = {"<|channel|>": ("analysis", "final"), "<|message|>": (REASONING[0], ANSWER[0])}
HIDDEN, HEAD = 64, 16
FLAG, SWITCHED = HIDDEN - 1, (HIDDEN - 2, HIDDEN - 3)  # the residual's flag dimension, one per switch


def scripted_model(vocab: list[str]) -> LlamaForCausalLM:
    """The one-layer Llama of the module docstring over ``vocab`` (the harmony test vocabulary's tokens)."""
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD, max_position_embeddings=2048,
                         rope_theta=1e30, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    index = {t: i for i, t in enumerate(vocab)}
    slot = {t: s for s, t in enumerate((*_MARKUP, *REASONING, *ANSWER))}
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:  # every matrix 0 but what _script sets, the norms 1
                p.zero_()
            else:
                p.fill_(1.0)
        _script(model, index, slot)
    return model


def _script(model: LlamaForCausalLM, index: dict[str, int], slot: dict[str, int]) -> None:
    """Set the weights: embeddings, successors, the flag's attention and the switches' MLP units."""
    attn, mlp, head = model.model.layers[0].self_attn, model.model.layers[0].mlp, model.lm_head.weight
    last_pair = HEAD // 2 - 1  # the rotary pair with the lowest frequency: with rope_theta 1e30 it never turns
    for token, s in slot.items():
        model.model.embed_tokens.weight[index[token], s] = 1.0
        attn.q_proj.weight[last_pair, s] = 1.0  # head 0 asks "where is the flag?" at every scripted token
    flag = slot[REASONING[0]]
    attn.k_proj.weight[last_pair, flag] = 2.0  # only the flag answers: softmax puts all of head 0 on it
    attn.v_proj.weight[0, flag] = 1.0 / 8  # rms-normed one-hot inputs are 8: the flag's value is 1
    attn.o_proj.weight[FLAG, 0] = 1.0
    for token, s in slot.items():
        if token in _NEXT:
            head[index[_NEXT[token]], s] = 1.0
    for unit, (token, (without, with_flag)) in enumerate(_SWITCH.items()):
        mlp.gate_proj.weight[unit, FLAG] = 1.0  # SiLU(0) = 0: nothing before the flag
        mlp.up_proj.weight[unit, slot[token]] = 1.0  # zero unless the current token is this one
        mlp.down_proj.weight[SWITCHED[unit], unit] = 1.0 / 32  # SiLU(5.66) x 5.66 = 32: the product becomes 1
        head[index[without], slot[token]] = 1.0
        head[index[with_flag], SWITCHED[unit]] = 4.0


def write_scripted_gguf(directory: Path) -> Path:
    """The scripted model as a GGUF file (the tiny Llama's tensor types) with the harmony vocabulary and template."""
    from tests.decoding.conftest import write_gguf

    vocab = read_vocab(write_vocab("harmony", directory)).tokens
    path = Path(directory) / "harmony-scripted.gguf"
    write_gguf(path, scripted_model(vocab), metadata=lambda w: add_vocab(w, "harmony"))
    return path
