"""decoding.runtime.gguf.tokenizer: a GGUF file's tokenizer from its metadata alone, with llama.cpp's token ids.

The vocabularies are ``gguf_vocabs.py``'s (byte-level BPE ones reuse the bundled SmolLM2 vocabulary: ``real_model``);
the ids they must give are llama.cpp's, committed in ``gguf_tokenizer_ids.json`` beside this file
(``python -m bench.gguf_tokens --write-expected`` remakes it). Where the bench extra and a llama.cpp build are
installed, ``tests/bench/test_gguf_tokens.py`` recomputes them with llama.cpp itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from decoding.errors import ModelFileError
from decoding.runtime import kernels
from decoding.runtime.gguf.tokenizer import PRE_TOKENIZERS, end_of_turn_ids, read_vocab, tokenizer_from_gguf
from decoding.runtime.loader import LoadOptions, load_model, load_tokenizer
from decoding.speculative.prompt import build_prompt, render_chat
from tests.decoding.runtime.gguf_vocabs import EXPECTED, VOCABS, add_vocab, ours, texts_of, vocab_digest, write_vocab

WANT = json.loads(EXPECTED.read_text())["vocabs"]


def _marks(name: str) -> list[pytest.MarkDecorator]:
    return [pytest.mark.real_model] if VOCABS[name].model == "gpt2" else []


NAMES = [pytest.param(name, marks=_marks(name), id=name) for name in VOCABS]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A test vocabulary's GGUF file, written once per module."""
    directory = tmp_path_factory.mktemp("vocabs")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_vocab(name, directory)
        return made[name]

    return get


def test_the_committed_ids_cover_every_vocabulary_and_text() -> None:
    assert list(WANT) == list(VOCABS)
    for name, want in WANT.items():
        assert [case["text"] for case in want["cases"]] == texts_of(name), f"{name}: regenerate the expected ids"


@pytest.mark.parametrize("name", NAMES)
def test_ids_equal_llama_cpps(name: str, vocab_file: Callable[[str], Path]) -> None:
    """BOS as the file says and special tokens parsed (``ids``); special-token text as plain text (``plain``);
    the end-of-generation ids: all as llama.cpp gave them."""
    path, want = vocab_file(name), WANT[name]
    assert vocab_digest(path) == want["digest"], "the test vocabulary changed: regenerate the expected ids"
    got = ours(path, [case["text"] for case in want["cases"]])
    for case, ids, plain in zip(want["cases"], got["ids"], got["plain"], strict=True):
        assert ids == case["ids"], case["text"]
        assert plain == case["plain"], case["text"]
    assert got["eog"] == want["eog"]


def test_special_tokens_are_one_id_and_bos_follows_the_metadata(vocab_file: Callable[[str], Path]) -> None:
    mistral = tokenizer_from_gguf(vocab_file("mistral"))
    inst = mistral.convert_tokens_to_ids("[INST]")
    assert mistral("[INST]", add_special_tokens=False).input_ids == [inst]
    assert mistral("hi").input_ids[0] == mistral.bos_token_id == mistral.convert_tokens_to_ids("<s>")
    assert mistral.decode(mistral("Hello world").input_ids, skip_special_tokens=True) == "Hello world"
    phi3 = tokenizer_from_gguf(vocab_file("phi3"))  # Phi-3: a special token eats the whitespace after it
    assert phi3("<|user|>\n  hi", add_special_tokens=False).input_ids == phi3("<|user|>hi",
                                                                            add_special_tokens=False).input_ids


@pytest.mark.real_model
def test_byte_level_special_tokens_and_user_defined_tokens(vocab_file: Callable[[str], Path]) -> None:
    qwen = tokenizer_from_gguf(vocab_file("qwen2"))
    start, end = qwen.convert_tokens_to_ids("<|im_start|>"), qwen.convert_tokens_to_ids("<|im_end|>")
    assert qwen("<|im_start|>user<|im_end|>").input_ids[::2] == [start, end]  # no BOS: add_bos_token is false
    tool = qwen.convert_tokens_to_ids("<tool_call>")
    assert tool in qwen("<tool_call>", split_special_tokens=True).input_ids  # user-defined: always one token
    assert start not in qwen("<|im_start|>", split_special_tokens=True).input_ids  # control: plain text here
    llama3 = tokenizer_from_gguf(vocab_file("llama-bpe"))  # llama3 pre: BOS by default, digits in threes
    assert llama3("1234567").input_ids == [llama3.bos_token_id, *llama3.convert_tokens_to_ids(["123", "4", "56", "7"])]
    text = "Hello, world: 3.14159\n\n  ok"
    assert llama3.decode(llama3(text).input_ids, skip_special_tokens=True) == text


def test_chat_templates_render_with_jinja(vocab_file: Callable[[str], Path]) -> None:
    """Gemma-style: BOS once (the template writes it, the prompt is tokenized without adding another), the system
    message folded into the first user turn, the turn markers one token each."""
    gemma = tokenizer_from_gguf(vocab_file("gemma"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is it?"}]
    text = gemma.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nWhat is it?<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma.apply_chat_template(messages, add_generation_prompt=True)
    turn = gemma.convert_tokens_to_ids("<start_of_turn>")
    assert ids[:2] == [gemma.bos_token_id, turn] and ids.count(gemma.bos_token_id) == 1
    prompt = build_prompt(gemma, system="Be brief.", document="The doc.", question="What is it?", prefix_key=None)
    assert prompt.ids.count(gemma.bos_token_id) == 1 and prompt.ids[0] == gemma.bos_token_id
    assert gemma.decode(prompt.ids) == render_chat(gemma, system="Be brief.", document="The doc.",
                                                   question="What is it?")


@pytest.mark.real_model
def test_chatml_template_renders_with_jinja(vocab_file: Callable[[str], Path]) -> None:
    qwen = tokenizer_from_gguf(vocab_file("qwen2"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = qwen.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = qwen.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == qwen(text, add_special_tokens=False).input_ids
    assert ids.count(qwen.convert_tokens_to_ids("<|im_start|>")) == 3


def _spm_file(path: Path, extra: Callable[[gguf.GGUFWriter], None], tokens: list[str] | None = None) -> Path:
    """A small SentencePiece-style vocabulary (plus ``tokens``, control type) with ``extra`` metadata."""
    base = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "a", "b", *(tokens or [])]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(base)
    w.add_token_scores([0.0] * len(base))
    w.add_token_types([2, 3, 3, *[6] * 256, 1, 1, 1, *[3] * len(tokens or [])])
    extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_end_of_turn_ids_come_from_the_metadata(tmp_path: Path, vocab_file: Callable[[str], Path]) -> None:
    """EOS, EOT and EOM as the metadata names them (whatever their text), and tokens that mark an end of turn."""

    def ids(w: gguf.GGUFWriter) -> None:
        w.add_eos_token_id(2)
        w.add_uint32("tokenizer.ggml.eot_token_id", 262)  # <|turn_done|>
        w.add_uint32("tokenizer.ggml.eom_token_id", 263)  # <|tool_done|>

    path = _spm_file(tmp_path / "eot.gguf", ids, ["<|turn_done|>", "<|tool_done|>", "<|other|>", "<|im_end|>"])
    assert end_of_turn_ids(path) == (2, 262, 263, 265)  # EOS first; <|im_end|> by its text; <|other|> not
    assert end_of_turn_ids(read_vocab(path)) == end_of_turn_ids(gguf.GGUFReader(str(path)))
    gemma = vocab_file("gemma")
    tok = tokenizer_from_gguf(gemma)
    assert end_of_turn_ids(gemma) == (tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>"))


def test_what_it_cannot_reproduce_is_refused_in_one_line(tmp_path: Path) -> None:
    def bpe(pre: str | None, model: str = "gpt2") -> Path:
        path = tmp_path / f"{model}-{pre}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model(model)
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(["a", "b", "ab"])
        w.add_token_merges(["a b"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    with pytest.raises(ModelFileError) as err:
        read_vocab(bpe("gpt2"))  # llama.cpp's name is "gpt-2"
    message = str(err.value)
    assert "\n" not in message and "GGUF pre-tokenizer 'gpt2' (tokenizer.ggml.pre) is not supported" in message
    assert all(name in message for name in ("llama-bpe", "qwen2", "smollm", "gpt-2", "default"))
    with pytest.raises(ModelFileError, match=r"tokenizer model 't5' is not supported \(supported: gpt2, llama\)$"):
        read_vocab(bpe("default", "t5"))
    assert tokenizer_from_gguf(bpe(None))("ab").input_ids == [2]  # no pre: llama.cpp's "default", as it does
    assert set(PRE_TOKENIZERS) >= {"llama-bpe", "llama3", "qwen2", "smollm", "default", "gpt-2"}
    nothing = tmp_path / "nothing.gguf"
    w = gguf.GGUFWriter(str(nothing), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="has no tokenizer"):
        tokenizer_from_gguf(nothing)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFileError, match="corrupt, truncated or not a GGUF file"):
        tokenizer_from_gguf(junk)


@pytest.mark.skipif(kernels.load() is None, reason="no CPU kernels: no quantized runtime")
def test_a_gguf_alone_brings_its_tokenizer_and_end_of_turn_ids(tmp_path: Path, vocab_file: Callable[[str], Path],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """load_model of a bare GGUF (a base model: no chat template): the GGUF's own tokenizer, with llama.cpp's ids;
    its end-of-turn tokens among the EOS ids; one log line saying its prompts are plain question / answer text."""
    from tests.decoding.conftest import write_gguf

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(read_vocab(vocab_file("mistral")).tokens), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256)
    path = tmp_path / "base.gguf"
    write_gguf(path, LlamaForCausalLM(config).eval(), metadata=lambda w: add_vocab(w, "mistral", chat_template=False))
    with caplog.at_level(logging.INFO, logger="decoding.runtime.loader"):
        loaded = load_model(str(path), LoadOptions(local_files_only=True))
    assert isinstance(loaded.tokenizer, PreTrainedTokenizerFast) and loaded.tokenizer.chat_template is None
    for case in WANT["mistral"]["cases"]:
        assert loaded.tokenizer(case["text"]).input_ids == case["ids"], case["text"]
    assert load_tokenizer(path).get_vocab() == loaded.tokenizer.get_vocab()  # the CLI's tokenizer is the same
    assert loaded.eos_token_ids[0] == 2 and set(end_of_turn_ids(path)) <= set(loaded.eos_token_ids)
    said = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert len(said) == 1 and "plain" in said[0], said
    prompt = build_prompt(loaded.tokenizer, system="", document="the doc", question="what is it?", prefix_key=None)
    assert prompt.ids.count(loaded.tokenizer.bos_token_id) == 1 and prompt.ids[0] == loaded.tokenizer.bos_token_id
    assert loaded.tokenizer.decode(prompt.ids, skip_special_tokens=True).endswith("Question: what is it?\nAnswer:")


@pytest.mark.parametrize("name", ["mistral", "phi3", "gemma"])
def test_prompts_split_into_pieces_are_the_whole_prompt_tokenized(name: str, vocab_file: Callable[[str], Path]) -> None:
    """SentencePiece-style: a piece that continues text gets no space prefix, one after a Phi-3 special token loses
    its leading whitespace (as llama.cpp tokenizing the whole rendered prompt does); nothing is added to the text."""
    tok = tokenizer_from_gguf(vocab_file(name))
    history = [("What is it?", "A fox.")]
    for document, question in (("the quick brown fox", "what is it?"), ("  hello world\n\nthe end", "and the dog?")):
        rendered = render_chat(tok, system="Answer briefly.", document=document, question=question, history=history)
        prompt = build_prompt(tok, system="Answer briefly.", document=document, question=question, history=history,
                              prefix_key=None)
        assert prompt.ids == tok(rendered, add_special_tokens=False).input_ids, rendered
        pieces = build_prompt(tok, system="Answer briefly.", document=["the quick ", "brown fox"], question=question,
                              prefix_key=None)
        whole = render_chat(tok, system="Answer briefly.", document="the quick brown fox", question=question)
        assert tok.decode(pieces.ids) == tok.decode(tok(whole, add_special_tokens=False).input_ids)
    base = tokenizer_from_gguf(vocab_file(name))
    base.chat_template = None
    rendered = render_chat(base, system="", document="the doc", question="what is it?")
    prompt = build_prompt(base, system="", document="the doc", question="what is it?", prefix_key=None)
    assert prompt.ids == base(rendered, add_special_tokens=False).input_ids
