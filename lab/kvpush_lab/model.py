"""Tiny random-weight models with a locally trained tokenizer, for end-to-end tests.

Nothing can be downloaded from a model hub on the machines kvpush is tested on, so the tests
make their own model: a Hugging Face config with random weights saved with ``save_pretrained``,
and a byte-level BPE tokenizer trained with ``tokenizers`` on generated text, saved as a
``PreTrainedTokenizerFast`` with a ChatML chat template. vLLM serves the directory like any
other checkpoint. Two makers:

* :func:`make_tiny_model`, of three architectures (``architecture``): ``qwen3``, every layer
  full attention (one KV cache group in vLLM); ``gemma3``, whose layers alternate sliding-window
  and full attention (``layer_types``), which vLLM's hybrid KV cache manager keeps as two KV
  cache groups, the sliding-window one holding only the blocks of the last ``sliding_window``
  tokens; ``nemotron_h``, a hybrid of Mamba-2 (SSM state), attention and MLP layers in turn,
  whose Mamba group holds one state per request (vLLM CPU serves it with
  ``--no-enable-prefix-caching``);
* :func:`make_tiny_mla_model`: DeepSeek-V3 (multi-head latent attention: one 576-wide latent
  per token and layer, the same on every tensor parallel rank), dense layers only. Its latent
  keeps DeepSeek's kv_lora_rank 512 + qk_rope_head_dim 64, the only size vLLM's CPU MLA decode
  kernel takes; everything else is tiny.

The weights use ``initializer_range=0.1`` rather than Hugging Face's 0.02: with 0.02 a random
tiny model largely ignores its context, so its greedy output barely depends on the KV cache
and a broken transfer could still produce the expected tokens.

``transformers``, ``tokenizers`` and ``torch`` are imported when a model is made, never when
kvpush is imported: kvpush itself does not depend on them (``scripts/setup-vllm`` installs them).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import random
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

MANIFEST = "kvpush-tiny-model.json"
# Bumped whenever the files this module writes change for the same parameters.
GENERATOR_VERSION = 1

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MAX_POSITIONS = 32768
ARCHITECTURES = ("qwen3", "gemma3", "nemotron_h")


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the generated files; stored as the directory's manifest."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    bpe_vocab: int
    seed: int
    initializer_range: float
    train_text_sha256: str
    generator_version: int = GENERATOR_VERSION
    architecture: str = "qwen3"
    #: gemma3: tokens a sliding-window layer attends to; every other layer (from the first) is
    #: a sliding-window layer, the rest full attention.
    sliding_window: int | None = None


@dataclass(frozen=True)
class TinyMlaModelSpec:
    """The MLA model's manifest: everything that determines its files."""

    layers: int
    hidden: int
    heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    intermediate: int
    bpe_vocab: int
    seed: int
    initializer_range: float
    train_text_sha256: str
    architecture: str = "DeepseekV3ForCausalLM"
    generator_version: int = GENERATOR_VERSION


Spec = TinyModelSpec | TinyMlaModelSpec


def generated_text(seed: int = 0, words: int = 60_000) -> str:
    """Deterministic pseudo-English (syllable words, numbers, punctuation) to train BPE on."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    lexicon = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)
    ]
    # Zipf-like weights, so that frequent words become single tokens and rare ones split.
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    out: list[str] = []
    sentence: list[str] = []
    for word in rng.choices(lexicon, weights, k=words):
        roll = rng.random()
        if roll < 0.03:
            word = str(rng.randint(0, 99_999))
        elif roll < 0.10:
            word = word.capitalize()
        sentence.append(word)
        if len(sentence) >= rng.randint(6, 18):
            out.append(" ".join(sentence) + rng.choice("..!?;,"))
            sentence = []
            if rng.random() < 0.15:
                out.append("\n")
    return " ".join(out)


def make_tiny_model(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int | None = None,
    bpe_vocab: int = 2048,
    vocab_train_text: str | None = None,
    seed: int = 0,
    initializer_range: float = 0.1,
    architecture: str = "qwen3",
    sliding_window: int = 256,
) -> Path:
    """Make (or reuse) a random-weight checkpoint with its tokenizer at ``path``.

    ``architecture`` is ``qwen3`` (full attention), ``gemma3`` (layers alternate
    ``sliding_window``-token sliding-window and full attention; ``sliding_window`` is ignored
    otherwise) or ``nemotron_h`` (Mamba-2, attention and MLP layers in turn).

    ``vocab_train_text`` is the BPE training corpus; by default :func:`generated_text` of
    ``seed``. ``bpe_vocab`` is the BPE trainer's target; the model's vocabulary is the trained
    tokenizer's ``len()``. A directory whose manifest matches these parameters is returned as
    it is; one made by this function with other parameters is replaced; any other non-empty
    directory is refused (:class:`FileExistsError`).
    """
    text = generated_text(seed) if vocab_train_text is None else vocab_train_text
    spec = TinyModelSpec(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate if intermediate is not None else 2 * hidden,
        bpe_vocab=bpe_vocab,
        seed=seed,
        initializer_range=initializer_range,
        train_text_sha256=hashlib.sha256(text.encode()).hexdigest(),
        architecture=architecture,
        sliding_window=sliding_window if architecture == "gemma3" else None,
    )
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: expected one of {ARCHITECTURES}")
    if architecture in ("gemma3", "nemotron_h") and layers < 2:
        raise ValueError(f"a {architecture} model needs 2 layers or more (two kinds of layer)")
    if heads % kv_heads != 0:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    return _materialise(Path(path), spec, text)


def make_tiny_mla_model(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    qk_nope_head_dim: int = 32,
    v_head_dim: int = 32,
    intermediate: int | None = None,
    bpe_vocab: int = 2048,
    vocab_train_text: str | None = None,
    seed: int = 0,
    initializer_range: float = 0.1,
) -> Path:
    """Make (or reuse) a random-weight DeepSeek-V3 (MLA) checkpoint with its tokenizer at ``path``.

    Every layer is dense (``first_k_dense_replace`` is the number of layers: no mixture of
    experts) and queries are projected directly (``q_lora_rank`` None, as in DeepSeek-V2-Lite).
    ``kv_lora_rank + qk_rope_head_dim`` is the latent vLLM caches per token; its CPU MLA decode
    kernel takes 576 only (the defaults). The tokenizer, the manifest and the reuse rules are
    :func:`make_tiny_model`'s.
    """
    text = generated_text(seed) if vocab_train_text is None else vocab_train_text
    spec = TinyMlaModelSpec(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim,
        intermediate=intermediate if intermediate is not None else 2 * hidden,
        bpe_vocab=bpe_vocab,
        seed=seed,
        initializer_range=initializer_range,
        train_text_sha256=hashlib.sha256(text.encode()).hexdigest(),
    )
    return _materialise(Path(path), spec, text)


def _materialise(target: Path, spec: Spec, text: str) -> Path:
    """``target`` holding the model of ``spec``: reused when its manifest matches, else made."""
    manifest = target / MANIFEST
    if manifest.is_file():
        if _read_manifest(manifest) == asdict(spec) and _complete(target):
            return target
    elif target.exists() and any(target.iterdir()):
        raise FileExistsError(
            f"{target} is not empty and has no {MANIFEST}: not a tiny model made by kvpush; "
            "pass an empty or missing directory"
        )

    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so an interrupted run never leaves a half model.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_model(staging, spec, text)
        staging.chmod(0o755)  # mkdtemp makes it private; a model directory is not
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def _read_manifest(manifest: Path) -> object:
    try:
        return json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None


def _complete(directory: Path) -> bool:
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all((directory / name).is_file() for name in needed)


def _require(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"making a tiny model needs {module!r} (with transformers, tokenizers and torch); "
            "install the vLLM stack with scripts/setup-vllm VENV"
        ) from exc


def _write_model(directory: Path, spec: Spec, text: str) -> None:
    transformers = _require("transformers")
    torch = _require("torch")
    tokenizer = _write_tokenizer(directory, spec.bpe_vocab, text)
    # What both kinds share: the tokenizer's vocabulary and ids, fp32, random weights.
    shared = {
        "vocab_size": len(tokenizer),
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": spec.initializer_range,
        "bos_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "torch_dtype": "float32",
    }
    if isinstance(spec, TinyMlaModelSpec):
        config = transformers.DeepseekV3Config(
            hidden_size=spec.hidden,
            intermediate_size=spec.intermediate,
            num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.heads,
            q_lora_rank=None,
            kv_lora_rank=spec.kv_lora_rank,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            qk_nope_head_dim=spec.qk_nope_head_dim,
            v_head_dim=spec.v_head_dim,
            head_dim=spec.qk_rope_head_dim,
            # Dense layers only: the mixture-of-experts settings below are never used, but
            # kept small and consistent for loaders that read them anyway.
            first_k_dense_replace=spec.layers,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=spec.intermediate // 4,
            n_group=1,
            topk_group=1,
            num_nextn_predict_layers=0,
            # vLLM's DeepSeek model has an lm_head of its own and never ties it to the
            # embedding: a tied checkpoint (no lm_head weight) would serve uniform logits.
            tie_word_embeddings=False,
            **shared,
        )
        model_class = transformers.DeepseekV3ForCausalLM
    else:
        config, model_class = _attention_config(transformers, spec, shared)
    torch.manual_seed(spec.seed)
    model = model_class(config)
    if isinstance(spec, TinyModelSpec) and spec.architecture == "gemma3":
        # Gemma multiplies the embeddings by sqrt(hidden): with random weights that residual
        # drowns what attention adds, and the greedy output ignores the context (one token
        # repeated whatever the prompt). Scaled back, a changed prompt token changes it.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(spec.hidden**-0.5)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / MANIFEST).write_text(json.dumps(asdict(spec), indent=2) + "\n")


def _attention_config(
    transformers: ModuleType, spec: TinyModelSpec, shared: dict[str, Any]
) -> tuple[Any, Any]:
    """The config and model class of :func:`make_tiny_model`'s architectures."""
    common = {
        **shared,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "tie_word_embeddings": True,
    }
    if spec.architecture == "gemma3":
        layer_types = [
            "sliding_attention" if layer % 2 == 0 else "full_attention"
            for layer in range(spec.layers)
        ]
        config = transformers.Gemma3TextConfig(
            **common,
            sliding_window=spec.sliding_window,
            layer_types=layer_types,
            query_pre_attn_scalar=spec.head_dim,
        )
        config.architectures = ["Gemma3ForCausalLM"]
        return config, transformers.Gemma3ForCausalLM
    if spec.architecture == "nemotron_h":
        kinds = ("mamba", "attention", "mlp")
        expand = 2
        config = transformers.NemotronHConfig(
            **common,
            layers_block_type=[kinds[layer % 3] for layer in range(spec.layers)],
            ssm_state_size=16,
            mamba_num_heads=expand * spec.hidden // spec.head_dim,
            mamba_head_dim=spec.head_dim,
            n_groups=1,
            expand=expand,
            chunk_size=128,
        )
        config.architectures = ["NemotronHForCausalLM"]
        return config, transformers.NemotronHForCausalLM
    return transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM


def _write_tokenizer(directory: Path, bpe_vocab: int, text: str) -> Any:
    """Trains the byte-level BPE on ``text`` and saves it; returns the fast tokenizer."""
    tokenizers = _require("tokenizers")
    transformers = _require("transformers")

    byte_level = tokenizers.pre_tokenizers.ByteLevel
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = byte_level(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=byte_level.alphabet(),
        show_progress=False,
    )
    lines = text.splitlines(keepends=True)
    bpe.train_from_iterator(lines, trainer=trainer)

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    """``kvpush model make PATH`` (or ``python -m kvpush_lab.model PATH``): make a tiny model."""
    parser = argparse.ArgumentParser(
        prog="kvpush model make",
        description=(
            "Make (or reuse) a random-weight model (--architecture), or with --mla a "
            "DeepSeek-V3 (MLA) model, and its tokenizer in PATH."
        ),
    )
    parser.add_argument("path", type=Path, metavar="PATH")
    parser.add_argument(
        "--mla",
        action="store_true",
        help="DeepSeek-V3 multi-head latent attention (kv_lora_rank 512, rope 64)",
    )
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="qwen3")
    parser.add_argument("--sliding-window", type=int, default=256, help="gemma3 only")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="not with --mla")
    parser.add_argument("--head-dim", type=int, default=64, help="not with --mla")
    parser.add_argument("--bpe-vocab", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--initializer-range", type=float, default=0.1)
    args = parser.parse_args(argv)
    common = {
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "bpe_vocab": args.bpe_vocab,
        "seed": args.seed,
        "initializer_range": args.initializer_range,
    }
    try:
        if args.mla:
            path = make_tiny_mla_model(args.path, **common)
        else:
            path = make_tiny_model(
                args.path,
                kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                architecture=args.architecture,
                sliding_window=args.sliding_window,
                **common,
            )
    except (FileExistsError, ImportError, ValueError) as exc:
        print(f"kvpush model make: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
