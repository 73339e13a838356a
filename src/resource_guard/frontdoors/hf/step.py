"""The Hugging Face ``Trainer``'s training step, as the estimates trace it.

What ``transformers.Trainer`` runs for one micro-batch, rebuilt from its arguments so that
:func:`~resource_guard.frontdoors.hf.plan.plan_training_args` (before the Trainer exists) and
:class:`~resource_guard.frontdoors.hf.trainer.ResourceGuardCallback` (inside it) trace the same step:

- the loss (:func:`trainer_loss`): the model's own (``model(**batch).loss``), or, with
  ``label_smoothing_factor``, transformers' ``LabelSmoother`` over the logits (labels shifted for a causal
  LM, as the Trainer does), or the Trainer's ``compute_loss_func(outputs, labels)``;
- the optimizer (:func:`trainer_optimizer`): the class and arguments the ``optim=`` name gives
  (``Trainer.get_optimizer_cls_and_kwargs``, so every name the Trainer knows, 8-bit ones included where
  bitsandbytes is installed), over the trainable parameters in the Trainer's two weight-decay groups;
- the step (:func:`trainer_step`): loss, backward, ``clip_grad_norm_`` when ``max_grad_norm > 0``, the
  optimizer's step, ``zero_grad`` — a :class:`~resource_guard.estimate.user_step.UserStep`;
- the precision (:func:`precision_of`) and the batches (:func:`sample_batch`, :func:`declared_length`):
  rows of the dataset through the collator, the longest sequence the collator or the dataset declares.

Everything read from transformers goes through the functions of this module, named in
:data:`TRANSFORMERS_SEAMS`; ``tests/frontdoors/test_hf_trainer.py`` fails loudly when one moves.

Example:
    >>> from transformers import TrainingArguments
    >>> precision_of(TrainingArguments("out", use_cpu=True, bf16=True, report_to=[]))
    'bf16-mixed'
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.estimate.user_step import StepContext, UserStep
from resource_guard.step.training import call_loss_fn, default_loss_fn, map_tensors

__all__ = [
    "TRANSFORMERS_SEAMS",
    "checkpointing_fields",
    "declared_length",
    "longest_batch",
    "precision_of",
    "sample_batch",
    "trainer_collator",
    "trainer_loss",
    "trainer_optimizer",
    "trainer_step",
    "unwrap_optimizer",
]

TRANSFORMERS_SEAMS = {
    "trainer_collator": (
        "transformers.Trainer.__init__: DataCollatorWithPadding(processing_class) for a "
        "PreTrainedTokenizerBase or SequenceFeatureExtractor, else default_data_collator"
    ),
    "trainer_optimizer": "transformers.Trainer.get_optimizer_cls_and_kwargs(args, model) (static)",
    "trainer_loss": "transformers.trainer_pt_utils.LabelSmoother(epsilon)(outputs, labels, shift_labels=)",
    "is_causal_lm": "transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "decay_parameter_names": (
        "transformers.trainer_pt_utils.get_parameter_names, transformers.pytorch_utils.ALL_LAYERNORM_LAYERS"
    ),
    "checkpointing_fields": (
        "TrainingArguments.activation_checkpointing(_kwargs) (5.x), else gradient_checkpointing(_kwargs)"
    ),
}

LossOf = Callable[[nn.Module, Any], Any]  # a loss, or an output with `.loss` (the estimate's LossFn)


def precision_of(args: Any) -> str | None:
    """The precision ``args`` fixes (``bf16`` → ``"bf16-mixed"``, ``fp16`` → ``"16-mixed"``); ``None``
    when neither is set (the Trainer then trains in float32)."""
    if getattr(args, "bf16", False):
        return "bf16-mixed"
    if getattr(args, "fp16", False):
        return "16-mixed"
    return None


def checkpointing_fields(args: Any) -> tuple[str, str]:
    """The names of the ``TrainingArguments`` fields that turn gradient checkpointing on and pass its
    arguments: ``activation_checkpointing(_kwargs)`` since transformers 5 (where the old
    ``gradient_checkpointing`` names only mirror them), else ``gradient_checkpointing(_kwargs)``."""
    names = {f.name for f in dataclasses.fields(args)} if dataclasses.is_dataclass(args) else set(vars(args))
    if "activation_checkpointing" in names:
        return "activation_checkpointing", "activation_checkpointing_kwargs"
    return "gradient_checkpointing", "gradient_checkpointing_kwargs"


def base_model_of(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (``PeftModel.get_base_model()``), else ``model``."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def is_causal_lm(model: nn.Module) -> bool:
    """Whether the Trainer shifts the labels for label smoothing: the model is a causal LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(base_model_of(model)).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def trainer_loss(
    model: nn.Module,
    args: Any,
    *,
    compute_loss_func: Callable[..., Any] | None = None,
    loss_fn: LossOf | None = None,
) -> LossOf:
    """``(model, batch) -> loss`` as ``Trainer.compute_loss`` computes it (module docstring); the
    model's own loss is returned as the model's output (the estimate reads its ``.loss``).

    ``loss_fn`` (a Trainer subclass's own ``compute_loss``, written as ``loss_fn(model, batch)``) wins.
    """
    if loss_fn is not None:
        return loss_fn
    smoothing = float(getattr(args, "label_smoothing_factor", 0.0) or 0.0)
    if compute_loss_func is None and smoothing == 0:
        return default_loss_fn  # `model(**batch)`; its `.loss` is read by the estimate
    smoother: Any = None
    if compute_loss_func is None:
        from transformers.trainer_pt_utils import LabelSmoother

        smoother = LabelSmoother(epsilon=smoothing)
    shift = is_causal_lm(model)

    def split_loss(m: nn.Module, batch: Any) -> torch.Tensor:
        if not isinstance(batch, Mapping) or "labels" not in batch:
            return default_loss_fn(m, batch)
        inputs = dict(batch)
        labels = inputs.pop("labels")
        outputs = m(**inputs)
        if compute_loss_func is not None:
            return compute_loss_func(outputs, labels, num_items_in_batch=None)
        return smoother(outputs, labels, shift_labels=shift)

    return split_loss


def trainer_step(loss_of: LossOf, max_grad_norm: float | None) -> UserStep:
    """One micro-step as the Trainer runs it: loss, backward, clipping, optimizer step, ``zero_grad``."""
    clip = float(max_grad_norm or 0.0)

    def hf_trainer_step(s: StepContext) -> None:
        s.backward(call_loss_fn(s.model, s.batch, loss_of))
        if clip > 0:
            params = [p for p in s.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, clip)
        for optimizer in s.optimizers:
            optimizer.step()
        s.model.zero_grad(set_to_none=True)

    return UserStep(hf_trainer_step, name="Trainer.training_step")


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` (its public ``.optimizer``)."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise ConfigurationError(
        f"the Trainer's optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer; "
        "resource_guard cannot estimate its state."
    )


def decay_parameter_names(model: nn.Module) -> set[str]:
    """The names the Trainer applies weight decay to (all but biases and norm weights)."""
    from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
    from transformers.trainer_pt_utils import get_parameter_names

    names = get_parameter_names(model, ALL_LAYERNORM_LAYERS, ["bias", "layernorm", "rmsnorm"])
    return set(names)


def trainer_optimizer(model: nn.Module, args: Any) -> torch.optim.Optimizer:
    """The optimizer ``Trainer.create_optimizer`` would build for ``args.optim``, over ``model``'s
    trainable parameters (no state allocated: optimizers create it at their first step).

    Raises:
        ConfigurationError: an ``optim`` the estimate cannot build (its package missing, or one that
            builds itself over the model, such as GaLore or LOMO).
    """
    from transformers import Trainer

    optim = getattr(args, "optim", "adamw_torch")
    name = str(getattr(optim, "value", optim))  # an OptimizerNames member
    try:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)  # type: ignore[arg-type]
    except (ImportError, ValueError) as error:
        raise ConfigurationError(
            f"`TrainingArguments(optim={name!r})`: the Trainer cannot build this optimizer here ({error})."
        ) from None
    kwargs = dict(kwargs)
    if "params" in kwargs or "model" in kwargs or not isinstance(cls, type):
        raise ConfigurationError(
            f"`TrainingArguments(optim={name!r})` builds its optimizer over the model itself; "
            "resource_guard cannot estimate its state. Use another `optim` or the plain-PyTorch `guard`."
        )
    decay = decay_parameter_names(model)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ConfigurationError("the model has no trainable parameter (every `requires_grad` is False).")
    groups = [
        {"params": [p for n, p in trainable if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
    ]
    return cls([g for g in groups if g["params"]], **kwargs)


def _forward_names(model: nn.Module) -> set[str] | None:
    """The columns the Trainer keeps (``Trainer._set_signature_columns_if_needed``): the named arguments of
    the model's ``forward`` (the base model's under PEFT) and the label names; a ``**kwargs`` takes no
    column of its own, as there."""
    params = inspect.signature(base_model_of(model).forward).parameters
    return {*params, "label", "label_ids", "labels"}


def trainer_collator(processing_class: Any = None) -> Callable[[list[Any]], Any]:
    """The collator a ``Trainer(data_collator=None, processing_class=...)`` uses: a
    ``DataCollatorWithPadding`` of the tokenizer (or feature extractor), which pads each batch to its
    longest row; else ``default_data_collator``."""
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase, default_data_collator
    from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor

    if isinstance(processing_class, (PreTrainedTokenizerBase, SequenceFeatureExtractor)):
        return DataCollatorWithPadding(processing_class)  # type: ignore[arg-type,no-any-return]
    return default_data_collator  # type: ignore[no-any-return]


def sample_batch(
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    rows: int,
    device: torch.device | str,
    *,
    model: nn.Module | None = None,
) -> Any:
    """The first ``rows`` rows of ``dataset`` through ``collate``, on ``device``: a batch as the Trainer's
    loader makes it (columns the model's ``forward`` does not take dropped, as ``remove_unused_columns``
    does, when ``model`` is given). The dataset is indexed (or, if iterable, iterated) directly: no
    sampler runs and no random state is drawn."""
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        count = min(rows, len(dataset))
        items = [dataset[i] for i in range(count)]
    else:
        items = list(itertools.islice(iter(dataset), rows))
    if not items:
        raise ConfigurationError("the training dataset is empty: there is nothing to plan on.")
    return _collated(items, collate, device, model)


def _collated(items: list[Any], collate: Callable[[list[Any]], Any], device: Any, model: Any) -> Any:
    keep = _forward_names(model) if model is not None else None
    if keep is not None and all(isinstance(item, Mapping) for item in items):
        items = [{k: v for k, v in item.items() if k in keep} for item in items]
    try:
        batch = collate(items)
    except ValueError as error:
        if not _ragged(items):
            raise
        name = getattr(getattr(collate, "data_collator", collate), "__name__", type(collate).__name__)
        raise ConfigurationError(
            f"the rows have different lengths and the collator ({name}) does not pad them ({error}). "
            "The Trainer pads each batch with `DataCollatorWithPadding` when it is given the tokenizer: "
            "pass the `processing_class=` (or `data_collator=`) the Trainer gets."
        ) from None
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)  # BatchEncoding: a plain dict, so the estimate's fast paths apply
    target = torch.device(device)
    return map_tensors(lambda t: t.to(target), batch)


def input_name_of(processing_class: Any) -> str | None:
    """The model input a tokenizer or processor names first (``group_by_length`` measures it)."""
    names = getattr(processing_class, "model_input_names", None)
    return names[0] if isinstance(names, (list, tuple)) and names and isinstance(names[0], str) else None


def _ragged(items: list[Any]) -> bool:
    """Rows (mappings) whose sequences differ in length."""
    lengths = {
        (key, len(value))
        for item in items
        if isinstance(item, Mapping)
        for key, value in item.items()
        if isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() >= 1)
    }
    return len(lengths) > len({key for key, _ in lengths})


_SCAN_ROWS = 200_000  # the longest example is looked for in datasets of at most this many rows


def _sequence_key(row: Any, preferred: str | None) -> str | None:
    if not isinstance(row, Mapping):
        return None
    names = [preferred] if preferred else []
    names += ["input_ids", "input_values", "input_features", *row.keys()]
    for name in names:
        value = row.get(name)
        if isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() >= 1):
            return name
    return None


def _lengths(dataset: Any, key: str) -> list[int]:
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, (list, tuple)) and key in columns:  # a datasets.Dataset: one column read
        return [len(v) for v in dataset[key]]
    return [len(dataset[i][key]) for i in range(len(dataset))]


def longest_batch(
    batch: Any,
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    rows: int,
    device: Any,
    *,
    model: nn.Module | None = None,
    input_name: str | None = None,
) -> tuple[Any, str] | None:
    """The batch a padding collator makes around the dataset's longest example, and where that was
    learnt; ``None`` when the dataset cannot be scanned or no example is longer than ``batch``.

    A collator that pads each batch to its longest row (``DataCollatorWithPadding``, the Trainer's
    choice for ``data_collator=None`` with a tokenizer) makes the run's largest batch where the longest
    example meets ``rows - 1`` others: the first batch of ``group_by_length``'s sampler, any batch that
    draws it otherwise. Built here as that example with the first ``rows - 1`` others, through the same
    collator (its padding, its ``pad_to_multiple_of``).
    """
    from resource_guard.planning.worst_case import sequence_positions
    from resource_guard.step.training import iter_tensors

    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        return None
    size = len(dataset)
    positions = sequence_positions(batch)
    if not 0 < size <= _SCAN_ROWS or not positions:
        return None
    key = _sequence_key(dataset[0], input_name)
    if key is None:
        return None
    try:
        lengths = _lengths(dataset, key)
    except Exception:  # rows of another form: no scan, the planned batch stays the first one
        return None
    longest = max(range(size), key=lengths.__getitem__)
    index, dim = min(positions)
    if lengths[longest] <= iter_tensors(batch)[index].shape[dim]:
        return None
    others = [i for i in range(min(rows, size)) if i != longest][: max(0, rows - 1)]
    made = _collated([dataset[i] for i in (longest, *others)], collate, device, model)
    return (
        made,
        f"the dataset's longest example, row {longest}: {lengths[longest]} {key}, padded by the collator",
    )


def declared_length(collate: Any) -> tuple[int, str] | None:
    """The longest sequence a padding collator can produce: its ``max_length`` (rounded up to its
    ``pad_to_multiple_of``), and where that was read; ``None`` when it does not cap the length."""
    collate = getattr(collate, "data_collator", collate)  # the Trainer's RemoveColumnsCollator wraps it
    length = getattr(collate, "max_length", None)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        return None
    multiple = getattr(collate, "pad_to_multiple_of", None)
    source = f"{type(collate).__name__}(max_length={length})"
    if isinstance(multiple, int) and not isinstance(multiple, bool) and multiple > 1:
        length = -(-length // multiple) * multiple
        source = f"{type(collate).__name__}(max_length=..., pad_to_multiple_of={multiple})"
    return length, source


def round_to_multiple(length: int, collate: Any) -> int:
    """``length`` rounded up to the collator's ``pad_to_multiple_of`` (if any)."""
    collate = getattr(collate, "data_collator", collate)
    multiple = getattr(collate, "pad_to_multiple_of", None)
    if isinstance(multiple, int) and not isinstance(multiple, bool) and multiple > 1:
        return -(-length // multiple) * multiple
    return length


def worst_case_of(
    batch: Any,
    *,
    max_seq_len: int | None,
    worst_case_batch: Any,
    collate: Any,
    dataset: Any,
) -> tuple[Any, str] | None:
    """The run's largest batch and where that was learnt, ``None`` when not knowable or not larger.

    ``worst_case_batch`` as given; else ``batch`` made as long as ``max_seq_len``, the collator's
    ``max_length`` (:func:`declared_length`), or the dataset's declared length or length column
    (:func:`~resource_guard.planning.worst_case.worst_case_length`), rounded up to the collator's
    ``pad_to_multiple_of``.
    """
    from resource_guard.planning.worst_case import resize_along, sequence_positions, worst_case_length
    from resource_guard.step.training import iter_tensors

    if worst_case_batch is not None:
        return worst_case_batch, "worst_case_batch="
    found: tuple[int, str] | None = None
    if max_seq_len is not None:
        found = max_seq_len, f"max_seq_len={max_seq_len}"
    if found is None:
        found = declared_length(collate)
    if found is None and dataset is not None:
        found = worst_case_length(dataset)
        if found is not None:
            found = round_to_multiple(found[0], collate), found[1]
    positions = sequence_positions(batch)
    if found is None or not positions:
        return None
    length, source = found
    index, dim = min(positions)
    if length <= iter_tensors(batch)[index].shape[dim]:
        return None
    return resize_along(batch, positions, length), source
