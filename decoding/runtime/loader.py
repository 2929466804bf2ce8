"""Loading target / drafter models, and the vocabulary checks that make drafted token ids meaningful.

``load_model(spec)`` accepts ``'bundled'`` (SmolLM2, see ``decoding.runtime.bundled``), a GGUF file, a local HF
model dir, or a hub id (resolved from the local HF cache; downloads only where the caller allows it and a
hub is reachable — transformers honours ``HF_HUB_OFFLINE`` itself). On a CPU the model runs on the
quantized runtime (``decoding.runtime.quantized``); on a GPU, or where the CPU kernels cannot be built, on
transformers (``decoding.runtime.torch_runtime``; on a GPU loaded there directly, not built in host memory first).
Either way ``LoadedModel.model`` is a ``TargetRuntime`` (``decoding.runtime.interface``). ``rope_scaling`` rewrites the
model's rotary scaling at load and raises its window to what that scaling supports (``apply_rope_scaling``);
``with_context_window`` sets the window a service uses, never beyond it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from decoding.errors import ModelFileError, ModelLoadError, VocabularyMismatch
from decoding.runtime.attention import use_grouped_sdpa
from decoding.runtime.bundled import BUNDLED
from decoding.runtime.interface import TargetRuntime
from decoding.runtime.kernels import load as load_kernels
from decoding.runtime.kernels import unavailable_reason, use_cpu_kernels
from decoding.runtime.rope import check_original_positions, check_rope_scaling
from decoding.runtime.torch_runtime import TorchRuntime

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_QUANT = ("auto", "q8_0", "q4_1", "none")  # weights of the CPU target (see load_model)
KV_DTYPES = {"auto": None, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
             "int8": torch.int8}
# ^ KV cache storage of the quantized CPU runtime (auto: bfloat16 where the attention multiplies bf16 operands,
#   float16 elsewhere: kernels.default_kv_dtype; int8: per 32 values with fp32 scales, lossy; opt-in)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A causal LM ready for inference with its tokenizer and the facts the engine needs."""

    model: TargetRuntime  # decoding.runtime.quantized.QuantizedModel, or a transformers model in a TorchRuntime
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    max_context: int  # config.max_position_embeddings (raised by rope_scaling), or less: with_context_window
    vocab_size: int  # width of the logits (config.vocab_size)

    @property
    def runtime(self) -> str:
        """``"torch:<dtype>"`` or ``"cpu-quantized:<weights>/kv-<dtype>"``, with ``"+rope-..."`` after the first word
        when load_model rewrote the rope scaling (the runtime's tag: the engine keys caches on it, so KV of another
        rope is never reused)."""
        return self.model.runtime_tag

    @property
    def weight_bytes(self) -> int:
        """Bytes of the served weights."""
        return self.model.weight_bytes


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``'auto'``: CUDA when available, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``'auto'``: bfloat16 on a GPU, float32 on a CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def apply_rope_scaling(config: Any, rope_scaling: dict[str, Any]) -> str:
    """Write ``rope_scaling`` into a model config and raise its window to what the scaling supports.

    The window (``max_position_embeddings``) becomes factor x the original positions (the dict's
    ``original_max_position_embeddings``, else the config's window), never less than the config's own:
    Llama-3.1 states more positions than its factor times its original. Yarn and llama3 get the original
    written into the dict: yarn would otherwise take the raised window as the original and move its
    frequency ramp. Only static scalings are accepted; a dynamic one changes the frequencies with the
    sequence length, which cached prefix KV and the quantized runtime's rotary tables cannot follow. A scaling
    the config has already (an HF config's, a GGUF's, or a GGUF's ``rope_freqs``) is replaced, with a warning.
    Returns a tag naming the scaling (it goes into ``LoadedModel.runtime``, which keys the KV caches).
    """
    rope_type, _ = check_rope_scaling(rope_scaling)  # the checks the app's settings run too (decoding.runtime.rope)
    scaling = dict(rope_scaling)
    scaling.pop("type", None)
    factor = scaling["factor"]
    own = int(getattr(config, "max_position_embeddings", 0) or 0)
    original = check_original_positions(scaling.get("original_max_position_embeddings") or own)
    scaling["rope_type"] = rope_type
    own_freqs = getattr(config, "rope_freqs", None) is not None  # a GGUF's (Llama-3.1): replaced, never stacked
    own_rope = getattr(config, "rope_scaling", None) or ("rope_freqs" if own_freqs else None)
    if own_rope:
        logger.warning("rope_scaling %s replaces the model's own rope scaling (%s)", scaling, own_rope)
    if own_freqs:
        config.rope_freqs = None
    if rope_type != "linear":  # linear's frequencies do not depend on it (and transformers warns of extra keys)
        scaling["original_max_position_embeddings"] = original
    config.rope_scaling = scaling
    config.max_position_embeddings = max(own, int(factor * original))
    from transformers.modeling_rope_utils import rope_config_validation

    try:
        rope_config_validation(config)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"rope_scaling {rope_scaling!r}: {exc}") from exc
    return f"rope-{rope_type}x{factor:g}@{original}"


def with_context_window(loaded: LoadedModel, tokens: int) -> LoadedModel:
    """``loaded`` with a window of ``tokens``: any size up to the positions the model supports (its config's,
    as raised by ``rope_scaling`` at load); beyond them it is refused, since positions past the ones a model was
    trained (or scaled) for give degraded output without any error."""
    if tokens > loaded.max_context:
        raise ModelLoadError(
            f"a {tokens}-token window is beyond the {loaded.max_context} positions {loaded.name} supports; "
            "a rope scaling the model was trained for (rope_scaling) raises that"
        )
    return dataclasses.replace(loaded, max_context=tokens)


def _gguf_file(path: Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``.gguf`` in a directory."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ModelFileError(f"{path} holds several GGUF files ({', '.join(f.name for f in found)}): name one")
        return found[0] if found else None
    return None


def _is_path(spec: str) -> bool:
    """Whether ``spec`` can only be a local path: absolute, relative by ``.`` or ``~``, a ``.gguf`` name, or more
    than one ``/`` (a hub id is ``name`` or ``owner/name``)."""
    return Path(spec).is_absolute() or spec.startswith((".", "~")) or spec.endswith(".gguf") or spec.count("/") > 1


def _resolve_source(spec: str, models_dir: Path | None, quantized: bool) -> tuple[str, str]:
    """(a local path or hub id to load, a display name). A path that does not exist is a ``ModelFileError`` here:
    taken for a hub id it would fail later with the hub client's complaint about repo names."""
    if spec == BUNDLED:
        from decoding.runtime import bundled
        from decoding.runtime.bundled import build as bundled_build

        if models_dir is None:
            raise ModelLoadError("model 'bundled' requested but no models_dir was given")
        if quantized:
            gguf_dir = bundled.bundled_gguf_dir(models_dir)
            if not bundled.has_gguf_dir(gguf_dir):
                raise ModelLoadError(f"bundled model missing at {gguf_dir}: run `ragspec models` first")
            return str(gguf_dir), f"{BUNDLED}:{gguf_dir.name}"
        if not bundled.is_converted(bundled.bundled_target_dir(models_dir)):
            logger.info("the torch runtime needs SmolLM2 in fp32: converting the bundled GGUF once")
        target = bundled_build.ensure_converted(models_dir)
        return str(target), f"{BUNDLED}:{target.name}"
    path = Path(spec).expanduser()
    if path.exists():
        if _gguf_file(path) is None and not (path / "config.json").is_file():
            raise ModelFileError(f"{path} is not a Hugging Face model dir (no config.json) nor a GGUF file")
        return str(path), path.name
    if _is_path(spec):
        raise ModelFileError(f"{path} does not exist")
    return spec, spec  # hub id


def _eos_ids(config: Any, generation_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a generation: tokenizer EOS plus the config / generation config EOS ids."""
    ids: list[int] = []
    sources = [tokenizer.eos_token_id, getattr(config, "eos_token_id", None)]
    if generation_config is not None:
        sources.append(generation_config.eos_token_id)
    for value in sources:
        for i in value if isinstance(value, list | tuple) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


_fallback_logged = False


def _quantized_runtime(dev: torch.device, dt: torch.dtype, cpu_quant: str, cpu_kernels: bool) -> bool:
    """Whether this load runs on the quantized CPU runtime; logs once why not where it was expected."""
    global _fallback_logged
    if cpu_quant not in CPU_QUANT:
        raise ModelLoadError(f"unknown cpu_quant {cpu_quant!r}; use one of {', '.join(CPU_QUANT)}")
    if dev.type != "cpu" or cpu_quant == "none" or dt != torch.float32 or not cpu_kernels:
        return False
    if load_kernels() is None:
        if not _fallback_logged:
            logger.warning("quantized CPU runtime unavailable (%s): serving fp32 weights on torch's kernels",
                           unavailable_reason())
            _fallback_logged = True
        return False
    return True


def _load_tokenizer(source: str, gguf: Path | None, local_files_only: bool) -> tuple[Any, tuple[int, ...]]:
    """The tokenizer of a model, and the ids its GGUF file says end a turn (empty where the tokenizer is not the
    GGUF's own). A GGUF without tokenizer files beside it brings its own tokenizer, built from its metadata with
    llama.cpp's token ids (``decoding.runtime.gguf.tokenizer``; transformers' GGUF tokenizer splits Llama 3's and
    Qwen's text otherwise, and misses their end-of-turn tokens); tokenizer files beside a GGUF (the bundled
    SmolLM2's) are used as they are."""
    root = Path(source) if gguf is None or Path(source).is_dir() else gguf.parent
    if gguf is not None and not (root / "tokenizer.json").is_file() and not (root / "tokenizer_config.json").is_file():
        from decoding.runtime.gguf.tokenizer import end_of_turn_ids, read_vocab, tokenizer_from_gguf

        vocab = read_vocab(gguf)
        return tokenizer_from_gguf(vocab), end_of_turn_ids(vocab)
    return AutoTokenizer.from_pretrained(str(root), local_files_only=local_files_only), ()


def load_tokenizer(path: str | Path, local_files_only: bool = True) -> Any:
    """The tokenizer ``load_model`` gives the local model at ``path`` (a GGUF file, a dir holding one, an HF dir),
    without its weights."""
    source = Path(path).expanduser()
    gguf = _gguf_file(source) if source.exists() else None
    return _load_tokenizer(str(source), gguf, local_files_only)[0]


def _generation_config(root: Path) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(root))
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class LoadOptions:
    """How ``load_model`` loads a model (every field has the default a plain CPU load wants).

    ``models_dir``: where ``'bundled'`` lives. ``device`` / ``dtype``: ``'auto'`` or a torch name. ``threads``:
    torch's intra-op threads (None: left as they are). ``local_files_only``: never look at a hub cache.
    ``cpu_kernels``: ragspec's CPU kernels (False: transformers only). ``cpu_quant``: the quantized CPU
    runtime's weight type (``'auto'``, ``'q8_0'``, ``'q4_1'``; ``'none'``: run transformers). ``kv_dtype``: its
    KV storage (``'auto'`` = float16, ``'float32'`` or ``'int8'``: per 32 values with their scales,
    36 / 64 of fp16's bytes a cached token, not the same answers). ``rope_scaling``: a rope scaling written into the
    config (see ``apply_rope_scaling``).
    """

    models_dir: Path | None = None
    device: str | torch.device = "auto"
    dtype: str | torch.dtype = "auto"
    threads: int | None = None
    local_files_only: bool = False
    cpu_kernels: bool = True
    cpu_quant: str = "auto"
    kv_dtype: str = "auto"
    rope_scaling: dict[str, Any] | None = None


def load_model(spec: str, options: LoadOptions | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer for inference.

    ``spec``: ``'bundled'`` (SmolLM2 under ``models_dir``, see ``decoding.runtime.bundled``), a GGUF file or a dir
    holding one (with the tokenizer files beside it, or the GGUF's own tokenizer), a local HF dir, or a hub id.
    On a CPU with fp32 activations the target runs on the quantized runtime (``decoding.runtime.quantized``) unless
    ``options.cpu_quant`` is ``'none'``: a GGUF's tensors as stored (each in its own type), an HF
    model quantized at load. Elsewhere transformers runs the model, an fp32 CPU model's small forwards on
    ``decoding.runtime.kernels`` (unless ``cpu_kernels`` is off). A ``rope_scaling`` (e.g. ``{"rope_type":
    "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}``) replaces the config's on every runtime
    and raises the window it reports. On a GPU the weights load onto it directly (``device_map``, accelerate):
    a model larger than host memory still loads.
    """
    o = options or LoadOptions()
    if o.threads is not None:
        torch.set_num_threads(int(o.threads))
    dev = resolve_device(o.device)
    dt = resolve_dtype(o.dtype, dev)
    quantized = _quantized_runtime(dev, dt, o.cpu_quant, o.cpu_kernels)
    if o.kv_dtype not in KV_DTYPES:
        raise ModelLoadError(f"unknown kv_dtype {o.kv_dtype!r}; use one of {', '.join(KV_DTYPES)}")
    if o.kv_dtype == "int8" and not quantized:
        raise ModelLoadError("kv_dtype int8 is a storage of the quantized CPU runtime; this model runs on "
                             f"{dev.type} {str(dt).removeprefix('torch.')} (use auto)")
    source, name = _resolve_source(spec, o.models_dir, quantized)
    gguf = _gguf_file(Path(source)) if Path(source).exists() else None
    try:
        config, rope_tag = None, ""
        if o.rope_scaling is not None and not (quantized and gguf is not None):  # a GGUF's config: weights_from_gguf
            config = _load_config(source, gguf, o.local_files_only)
            rope_tag = apply_rope_scaling(config, o.rope_scaling)
        model: TargetRuntime
        if quantized:
            model = _load_quantized(source, gguf, o, config, rope_tag)
            generation_config = _generation_config(Path(source) if Path(source).is_dir() else Path(source).parent)
        else:
            module = _load_torch(source, gguf, dt, o.local_files_only, dev, config)
            if dev.type != "cuda":  # a GPU load is there already (device_map)
                module.to(dev)  # in place
            use_grouped_sdpa(module)  # CPU: no KV head repetition under tree masks
            if o.cpu_kernels:
                use_cpu_kernels(module)
            generation_config = module.generation_config
            model = TorchRuntime(module, rope_tag)
        # after the weights: a corrupt GGUF, or one of another architecture, is named by the weights' reader
        # (read_gguf, gguf_config), not by whatever transformers' GGUF tokenizer trips over in it
        tokenizer, turn_ends = _load_tokenizer(source, gguf, o.local_files_only)
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"cannot load model {spec!r}: {exc}") from exc
    eos = _eos_ids(model.config, generation_config, tokenizer)
    eos += tuple(i for i in turn_ends if i not in eos)
    if not eos:
        raise ModelFileError(f"model {spec!r} defines no EOS token")
    max_context = model.max_positions
    if max_context <= 0:
        raise ModelFileError(f"model {spec!r} has no max_position_embeddings in its config")
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        device=dev,
        dtype=dt,
        eos_token_ids=eos,
        max_context=max_context,
        vocab_size=model.vocab_size,
    )
    logger.info("loaded %s on %s (%s, %.0f MB of weights, %d-token window, eos %s)", name, dev, loaded.runtime,
                loaded.weight_bytes / 1e6, max_context, eos)
    if getattr(tokenizer, "chat_template", None) is None:
        logger.info("%s has no chat template (a base model): its prompts are plain 'Context: / Question: / Answer:' "
                    "text", name)
    return loaded


def _load_config(source: str, gguf: Path | None, local_files_only: bool) -> Any:
    if gguf is not None:
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoConfig.from_pretrained(source, local_files_only=local_files_only)


def _load_torch(source: str, gguf: Path | None, dt: torch.dtype, local_files_only: bool, dev: torch.device,
                config: Any = None) -> Any:
    """A transformers model in ``dt``; on CUDA its weights go to the GPU as they are read (``device_map``, one
    device for every module), where building it in host memory first would need the whole model there."""
    kwargs: dict[str, Any] = {"dtype": dt, "attn_implementation": "sdpa", "local_files_only": local_files_only}
    if gguf is not None and config is None:  # transformers' GGUF reader leaves the rope scaling out
        from decoding.runtime.weights import gguf_torch_config

        config = gguf_torch_config(gguf)
    if config is not None:
        kwargs["config"] = config
    if dev.type == "cuda":
        kwargs["device_map"] = {"": dev}
    try:
        return _from_pretrained(source, gguf, kwargs)
    except ValueError as exc:  # a class without SDPA (gpt-oss's sinks): transformers' own eager attention
        if "scaled_dot_product_attention" not in str(exc):
            raise
        return _from_pretrained(source, gguf, {**kwargs, "attn_implementation": "eager"})


def _from_pretrained(source: str, gguf: Path | None, kwargs: dict[str, Any]) -> Any:
    if gguf is not None:  # transformers de-quantizes the GGUF to ``dt``
        return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **kwargs).eval()
    return AutoModelForCausalLM.from_pretrained(source, **kwargs).eval()


def _load_quantized(source: str, gguf: Path | None, o: LoadOptions, config: Any = None,
                    rope_tag: str = "") -> TargetRuntime:
    """The quantized CPU runtime's model (an HF model built from ``config`` when given, ``rope_tag`` naming the
    rope scaling written into it); a GGUF's config gets ``o.rope_scaling`` here, before its rotary tables are
    made."""
    from decoding.runtime.quant import NAMES, WeightType
    from decoding.runtime.quantized import QuantizedModel
    from decoding.runtime.weights import weights_from_gguf, weights_from_hf

    kind = NAMES.get(o.cpu_quant, WeightType.Q8_0)
    if gguf is not None:
        weights = weights_from_gguf(gguf)
        if o.rope_scaling is not None:
            rope_tag = apply_rope_scaling(weights.config, o.rope_scaling)
    else:
        extra: dict[str, Any] = {} if config is None else {"config": config}
        dense = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, local_files_only=o.local_files_only,
                                                     **extra)
        weights = weights_from_hf(dense, kind)
        del dense
    return QuantizedModel(weights, KV_DTYPES[o.kv_dtype], rope_tag)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hash of the token -> id mapping and the special tokens (keys the cross-session draft cache).

    Two tokenizers with the same fingerprint turn the same id sequences into the same text.
    """
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
        "special": sorted(
            (str(tok), int(tokenizer.convert_tokens_to_ids(tok))) for tok in tokenizer.all_special_tokens
        ),
    }
    blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _vocab_digest(tokenizer: Any) -> str:
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def check_same_vocab(target: LoadedModel, drafter: LoadedModel) -> None:
    """Raise ``VocabularyMismatch`` unless drafter token ids mean the same as target token ids.

    The tokenizers' token -> id mappings must be equal; the logits widths may differ (Qwen2.5-7B pads to 152064
    rows, 0.5B-3B to 151936) if both cover every id of the tokenizer (RAPID fits q to the target's width).
    """
    ids = max(target.tokenizer.get_vocab().values(), default=-1) + 1  # ids the tokenizer can produce
    if target.vocab_size != drafter.vocab_size and min(target.vocab_size, drafter.vocab_size) < ids:
        raise VocabularyMismatch(
            f"target {target.name} has {target.vocab_size} logits but drafter {drafter.name} has "
            f"{drafter.vocab_size}, not both covering the tokenizer's {ids} ids: choose a drafter from the same "
            "model family and vocabulary"
        )
    if _vocab_digest(target.tokenizer) == _vocab_digest(drafter.tokenizer):
        return
    tv, dv = target.tokenizer.get_vocab(), drafter.tokenizer.get_vocab()
    differing = sorted(tok for tok in tv.keys() | dv.keys() if tv.get(tok) != dv.get(tok))
    example = differing[0]
    raise VocabularyMismatch(
        f"target {target.name} and drafter {drafter.name} tokenizers differ on {len(differing)} tokens "
        f"(e.g. {example!r}: target id {tv.get(example)}, drafter id {dv.get(example)})"
    )
