"""Hugging Face transformers as models (`model=hf`), with LoRA adapters through `peft`.

A model comes from a local directory (`model.path`, offline: `local_files_only`) or is built
from a config (`model.config`: a dict with `model_type`, or a JSON file), with its weights
seeded so that every process builds the same ones. `TextModel` wraps it the way the training
loop calls models: token ids in (N x T, -1 for padding), logits out.

The base weights never travel: every node builds the same base itself, and the server sends
the digest of its base (`base_digest`) with every task, which a node checks against its own
before training, so a node whose `model.path` holds other weights (or another torch version
initialised a config-built model differently) fails with the two digests named instead of
averaging adapters trained on different bases. Only the tensors that train (LoRA's adapters,
and the classification head they need) are sent and aggregated.

transformers and peft are imported inside the functions: the ClientApp of an image run never
pays for them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.config.schema import ConfigError, ModelConfig
from app.task.data import DataSpec

log = logging.getLogger("flwr.fedgpu." + __name__)

CONFIG_SEED = 0  # a config-built model's weights are drawn from this seed, the same in every process
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@lru_cache(maxsize=4)
def load_tokenizer(cfg: ModelConfig) -> Any:  # noqa: ANN401 - a transformers tokenizer
    """`model.tokenizer_path`, else the one in `model.path`, else a byte-level tokenizer (ByT5's:
    259 ids, no files, so config-built models need no download); a pad token where it lacks one."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    path = cfg.tokenizer_path or cfg.path
    if path is None:
        return ByT5Tokenizer(extra_ids=0)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(Path(path).expanduser()), local_files_only=True)
    except (OSError, ValueError) as err:
        key = "model.tokenizer_path" if cfg.tokenizer_path else "model.path"
        raise ConfigError(f"{key}={path}: no tokenizer there ({err}); set model.tokenizer_path") from err
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token  # decoder-only models ship without one
    return tokenizer


def hf_config(cfg: ModelConfig) -> Any:  # noqa: ANN401 - a transformers PretrainedConfig
    """The transformers config `model.config` gives: a dict (with `model_type`) or a JSON file."""
    from transformers import AutoConfig

    value = cfg.config
    if isinstance(value, str):
        try:
            value = json.loads(Path(value).expanduser().read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"model.config={cfg.config}: cannot read a JSON config there ({err})") from err
    if not isinstance(value, dict) or "model_type" not in value:
        raise ConfigError(
            f"model.config={cfg.config!r}: a transformers config with a model_type, e.g. "
            "{model_type: llama, hidden_size: 64, num_hidden_layers: 2, ...}, or the path of a config.json"
        )
    rest = {k: v for k, v in value.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(value["model_type"], **rest)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model.config: {err}") from err


class TextModel(nn.Module):
    """A transformers model called with token ids (N x T; -1 marks padding, which becomes the pad
    token and is masked out), returning its logits: N x T x vocabulary (causal LM) or N x classes."""

    def __init__(self, inner: nn.Module, pad_id: int, causal_lm: bool) -> None:
        super().__init__()
        self.inner, self.pad_id, self.causal_lm = inner, pad_id, causal_lm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x >= 0
        ids = x.masked_fill(~mask, self.pad_id)
        return self.inner(input_ids=ids, attention_mask=mask.long()).logits

    @property
    def adapted(self) -> bool:
        """Whether a peft adapter wraps the model (only its trainable tensors are sent)."""
        return hasattr(self.inner, "peft_config")


def _transformer(cfg: ModelConfig, spec: DataSpec, pad_id: int) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kind = AutoModelForCausalLM if spec.causal_lm else AutoModelForSequenceClassification
    extra: dict[str, Any] = {} if spec.causal_lm else {"num_labels": spec.num_classes, "pad_token_id": pad_id}
    dtype = DTYPES[cfg.dtype]
    if cfg.path is not None:
        try:
            return kind.from_pretrained(str(Path(cfg.path).expanduser()), local_files_only=True, dtype=dtype, **extra)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.path={cfg.path}: cannot load a transformers model there: {err}") from err
    config = hf_config(cfg)
    for key, value in extra.items():
        setattr(config, key, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(CONFIG_SEED)
        return kind.from_config(config, dtype=dtype)


def _lora(inner: nn.Module, cfg: ModelConfig, causal_lm: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules) or None,  # None: peft's default for the architecture
        task_type="CAUSAL_LM" if causal_lm else "SEQ_CLS",
    )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(CONFIG_SEED)
            return get_peft_model(inner, lora)
    except ValueError as err:
        modules = sorted({n.rsplit(".", 1)[-1] for n, m in inner.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            f"model.peft=lora: {err}; set model.lora_target_modules to some of this model's linear layers: {modules}"
        ) from err


def hf_model(cfg: ModelConfig, spec: DataSpec) -> TextModel:
    """The configured transformer for this data (causal LM or sequence classification), with a
    LoRA adapter when `model.peft=lora`."""
    pad_id = load_tokenizer(cfg).pad_token_id
    inner = _transformer(cfg, spec, 0 if pad_id is None else int(pad_id))
    if cfg.peft == "lora":
        inner = _lora(inner, cfg, spec.causal_lm)
    return TextModel(inner, 0 if pad_id is None else int(pad_id), spec.causal_lm)


def adapter_keys(model: TextModel) -> list[str]:
    """The state_dict keys a peft model trains: its adapters (and the head a classifier needs)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return [k for k in model.state_dict() if k in names]


def base_digest(state: dict[str, torch.Tensor]) -> str:
    """blake2b of the frozen tensors (names, dtypes, shapes and bytes, in name order)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def check_base(own: dict[str, torch.Tensor], expected: str, cfg: ModelConfig) -> None:
    """A node's frozen base must be the server's (`BASE_DIGEST`): refuse to train on another."""
    digest = base_digest(own)
    if digest != expected:
        source = f"model.path={cfg.path}" if cfg.path else "model.config (weights seeded; check torch versions)"
        raise ValueError(
            f"this node's base model ({source}) has digest {digest}, the server's has {expected}: give every node "
            "the same weights (e.g. copy the server's model directory) before it trains"
        )


def export(model: TextModel, cfg: ModelConfig, out: Path) -> list[Path]:
    """Write the trained model as transformers directories: `out/adapter` (peft: loadable with
    `PeftModel.from_pretrained`) and `out/merged` (the adapters merged into the base, with the
    tokenizer): what a user loads with `AutoModelFor*.from_pretrained`."""
    written = []
    inner = model.inner
    if model.adapted:
        inner.save_pretrained(str(out / "adapter"))
        written.append(out / "adapter")
        inner = inner.merge_and_unload()  # the module is done with: merging in place saves a copy
        model.inner = inner
    inner.save_pretrained(str(out / "merged"))
    load_tokenizer(cfg).save_pretrained(str(out / "merged"))
    written.append(out / "merged")
    return written
