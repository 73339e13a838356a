"""Bad input is refused before any training step, with an error that names the argument and the fix.

Every front door is tried: :func:`estimate_memory`, :func:`plan`, :func:`guard` (constructor and
enter), the Lightning :class:`ResourceGuard` (constructor and ``fit`` with a tiny Trainer) and
``resource-guard preflight`` (exit 2, one paragraph, no traceback). Inputs that are unusual but valid
(float64 models, batches of every common shape with non-tensor leaves) must work, estimate what a real
CPU step measures, and split into micro-batches of the same shape.

The bad inputs tried are the parametrized cases below; ``len(BAD_*)`` of each list counts them.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

from cpu_reference import measure_reference
from resource_guard import estimate_memory, guard, plan
from resource_guard.cli import main
from resource_guard.devices import load_catalog
from resource_guard.errors import ConfigurationError
from resource_guard.step.batching import split_batch
from resource_guard.step.training import batch_size_of, iter_tensors

DIM = 8
ROWS = 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 3))


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _x() -> torch.Tensor:
    return torch.randn(ROWS, DIM)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch).square().mean()


def _no_grad_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(batch).sum()


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


class LossDict(nn.Module):
    """Returns ``{"loss": ...}`` whose loss is per sample, not reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.lin(x)}


# ---------------------------------------------------------------------------------------------------
# estimate_memory and plan: (case id, arguments that differ from a good call, words the message must have)

BAD_CORE: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("model-not-module", {"model": lambda x: x}, ("model=", "torch.nn.Module")),
    ("model-none", {"model": None}, ("model=", "torch.nn.Module")),
    ("model-no-parameters", {"model": nn.ReLU()}, ("model=", "no parameters")),
    ("model-empty-sequential", {"model": nn.Sequential()}, ("model=", "no parameters")),
    ("model-all-frozen", {"model": Frozen(), "loss_fn": None}, ("model=", "requires grad", "unfreeze")),
    (
        "optimizer-foreign-params",
        {"optimizer": "foreign"},
        ("optimizer=", "not the model's", "model.parameters()"),
    ),
    ("optimizer-not-optimizer", {"optimizer": 3}, ("optimizer=", "torch.optim.Optimizer")),
    (
        "optimizer-factory-returns-junk",
        {"optimizer": lambda params: "adam"},
        ("factory", "torch.optim.Optimizer"),
    ),
    ("batch-none", {"batch": None}, ("batch=None", "sample batch")),
    ("loss-fn-not-callable", {"loss_fn": 3}, ("loss_fn=3", "callable")),
    ("loss-non-scalar", {"loss_fn": lambda m, b: m(b)}, ("shape (12, 3)", "scalar", "loss_fn")),
    ("loss-default-non-scalar", {"loss_fn": None}, ("shape (12, 3)", "scalar", "loss_fn")),
    ("loss-dict-non-scalar", {"model": LossDict(), "loss_fn": None}, ("shape (12, 1)", "scalar", "mean")),
    ("loss-none", {"loss_fn": lambda m, b: None}, ("scalar loss", "loss_fn")),
    ("loss-python-float", {"loss_fn": lambda m, b: 1.0}, ("scalar loss", "loss_fn")),
    ("loss-no-grad", {"loss_fn": _no_grad_loss}, ("does not require grad", "no_grad")),
    ("loss-detached", {"loss_fn": lambda m, b: m(b).sum().detach()}, ("does not require grad", "detach")),
    ("precision-unknown", {"precision": "fp8"}, ("precision='fp8'", "32-true", "bf16-mixed")),
    ("precision-none", {"precision": None}, ("precision=None", "32-true")),
    ("device-unknown", {"device": "tpu-v5"}, ("device='tpu-v5'", "resource-guard devices")),
    ("device-typo", {"device": "a100-40"}, ("device='a100-40'", "Did you mean")),
    ("device-not-a-name", {"device": 3}, ("device=3",)),
]


def _call_args(changes: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {"model": _model(), "optimizer": _sgd, "batch": _x(), "loss_fn": _loss}
    args.update(changes)
    if args["optimizer"] == "foreign":
        args["optimizer"] = _sgd(nn.Linear(2, 2).parameters())
    return args


@pytest.mark.parametrize(("changes", "words"), [c[1:] for c in BAD_CORE], ids=[c[0] for c in BAD_CORE])
def test_estimate_memory_refuses_bad_input(changes, words):
    a = _call_args(changes)
    device = a.pop("device", "cpu")
    with pytest.raises(ConfigurationError) as info:
        estimate_memory(
            a["model"],
            a["optimizer"],
            a["batch"],
            a["loss_fn"],
            device=device,
            precision=a.get("precision", "32-true"),
        )
    for word in words:
        assert word in str(info.value)
    if "model=" in words[0] or "optimizer=" in words[0] or "device=" in words[0]:
        assert "estimate_memory(" in str(info.value)


BAD_PLAN_ONLY: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("target-zero", {"target_batch_size": 0}, ("target_batch_size=0", "positive int")),
    ("target-negative", {"target_batch_size": -8}, ("target_batch_size=-8", "positive int")),
    ("target-float", {"target_batch_size": 2.5}, ("target_batch_size=2.5",)),
    ("target-bool", {"target_batch_size": True}, ("target_batch_size=True",)),
    ("headroom-negative", {"headroom": -0.1}, ("headroom=-0.1", "[0, 0.9)")),
    ("headroom-0.9", {"headroom": 0.9}, ("headroom=0.9", "[0, 0.9)")),
    ("headroom-1.5", {"headroom": 1.5}, ("headroom=1.5", "[0, 0.9)")),
    ("headroom-nan", {"headroom": float("nan")}, ("headroom=nan", "[0, 0.9)")),
    ("headroom-string", {"headroom": "0.1"}, ("headroom='0.1'",)),
    ("world-size-zero", {"world_size": 0}, ("world_size=0",)),
    ("strategy-unknown", {"strategy": "zero3"}, ("strategy='zero3'", "fsdp")),
    ("memory-limit-words", {"memory_limit": "lots"}, ("memory_limit='lots'", "GiB")),
    ("memory-limit-negative", {"memory_limit": -1}, ("memory_limit=-1", "negative")),
    ("memory-limit-zero", {"memory_limit": 0}, ("memory_limit=0",)),
    ("catalog-wrong-type", {"catalog": 42}, ("catalog=42", "load_catalog")),
    ("batch-empty", {"batch": torch.randn(0, DIM)}, ("batch=", "0 rows")),
    ("batch-0d", {"batch": torch.tensor(1.0)}, ("batch=", "leading dimension")),
    (
        "batch-mismatched-rows",
        {"batch": (torch.randn(4, DIM), torch.randn(3))},
        ("batch=", "leading dimension"),
    ),
]


@pytest.mark.parametrize(
    ("changes", "words"),
    [c[1:] for c in BAD_CORE + BAD_PLAN_ONLY],
    ids=[c[0] for c in BAD_CORE + BAD_PLAN_ONLY],
)
def test_plan_refuses_bad_input(changes, words):
    a = _call_args(changes)
    model, optimizer, batch, loss_fn = (a.pop(k) for k in ("model", "optimizer", "batch", "loss_fn"))
    a.setdefault("device", "cpu")
    with pytest.raises(ConfigurationError) as info:
        plan(model, optimizer, batch, loss_fn, **a)
    for word in words:
        assert word in str(info.value)


def test_plan_accepts_a_catalog_path(tmp_path):
    path = tmp_path / "devices.yaml"
    path.write_text("devices:\n  - name: lab-gpu\n    kind: cuda\n    memory: 8GiB\n    bf16: true\n")
    made = plan(_model(), _sgd, _x(), _loss, device="lab-gpu", catalog=path)
    assert made.device.name == "lab-gpu" and made.precision == "bf16-mixed"


# ---------------------------------------------------------------------------------------------------
# guard(...): the constructor, or at the latest `with` (before any step)

BAD_GUARD: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("model-not-module", {"model": "net"}, ("guard(model=...)",)),
    ("optimizer-factory", {"optimizer": _sgd}, ("guard(optimizer=...)",)),
    ("target-zero", {"target_batch_size": 0}, ("guard(target_batch_size=0)",)),
    ("target-negative", {"target_batch_size": -1}, ("guard(target_batch_size=-1)",)),
    ("headroom-0.95", {"headroom": 0.95}, ("guard(headroom=0.95)", "[0, 0.9)")),
    ("headroom-negative", {"headroom": -0.5}, ("guard(headroom=-0.5)",)),
    ("precision-unknown", {"precision": "fp8"}, ("precision='fp8'",)),
    ("clip-negative", {"clip_grad_norm": -1.0}, ("clip_grad_norm=-1.0",)),
    ("headroom-bool", {"headroom": False}, ("guard(headroom=False)",)),
    ("device-unknown", {"device": "tpu-v5"}, ("device='tpu-v5'",)),
    ("checkpointing-unknown", {"checkpointing": "yes"}, ("checkpointing='yes'",)),
    ("memory-limit-words", {"memory_limit": "lots"}, ("memory_limit='lots'",)),
    ("catalog-missing-file", {"catalog": "no-such-catalog.yaml"}, ("no-such-catalog.yaml",)),
]
BAD_GUARD_ENTER: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("device-catalog-only", {"device": "a100-40gb"}, ("catalog entry", "memory_limit")),
    ("empty-model", {"model": nn.ReLU(), "optimizer": "stray"}, ("no parameters",)),
    ("foreign-optimizer", {"optimizer": "foreign"}, ("not the model's",)),
    ("loss-non-scalar", {"loss_fn": lambda m, b: m(b)}, ("scalar",)),
    ("loss-no-grad", {"loss_fn": _no_grad_loss}, ("does not require grad",)),
    (
        "sample-batch-no-rows",
        {"sample_batch": (torch.randn(4, DIM), torch.randn(3))},
        ("do not share dim 0", "batch_dim=1"),
    ),
]


def _guard_args(changes: dict[str, Any]) -> dict[str, Any]:
    model = changes.pop("model", None) or _model()
    owner = model if isinstance(model, nn.Module) else _model()
    optimizer = changes.pop("optimizer", None) or _sgd(owner.parameters())
    if optimizer == "foreign":
        optimizer = _sgd(nn.Linear(2, 2).parameters())
    elif optimizer == "stray":
        optimizer = _sgd([nn.Parameter(torch.zeros(1))])
    args = {"sample_batch": _x(), "loss_fn": _loss, "device": "cpu", "monitor": False, **changes}
    return {"model": model, "optimizer": optimizer, **args}


@pytest.mark.parametrize(("changes", "words"), [c[1:] for c in BAD_GUARD], ids=[c[0] for c in BAD_GUARD])
def test_guard_constructor_refuses_bad_input(changes, words):
    with pytest.raises(ConfigurationError) as info:
        guard(**_guard_args(dict(changes)))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("changes", "words"), [c[1:] for c in BAD_GUARD_ENTER], ids=[c[0] for c in BAD_GUARD_ENTER]
)
def test_guard_enter_refuses_bad_input_before_any_step(changes, words):
    args = _guard_args(dict(changes))
    if changes.get("sample_batch") is not None:
        args.pop("loss_fn")
    g = guard(**args)
    with pytest.raises(ConfigurationError) as info:
        with g:
            pytest.fail("the body must not run")  # pragma: no cover
    for word in words:
        assert word in str(info.value)
    assert g.optimizer_steps == 0 and g.micro_steps == 0


def test_guard_refuses_an_unwritable_log_dir_at_enter(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    g = guard(**_guard_args({"log_dir": blocker / "logs"}))
    with pytest.raises(ConfigurationError, match="log_dir=.*not writable"):
        with g:
            pytest.fail("the body must not run")  # pragma: no cover
    assert g.plan is None  # refused before planning


# ---------------------------------------------------------------------------------------------------
# the Lightning callback: constructor, then `fit` with a tiny Trainer (no training step may run)


def _lightning():
    lightning = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    class Net(lightning.LightningModule):
        def __init__(self, mode: str = "ok") -> None:
            super().__init__()
            self.lin = nn.Linear(DIM, 1)
            self.mode = mode
            self.real_steps = 0

        def training_step(self, batch, batch_idx):
            if self._trainer is not None:
                self.real_steps += 1
            out = self.lin(batch[0])
            if self.mode == "non-scalar":
                return {"loss": out}
            if self.mode == "no-grad":
                return out.detach().mean()
            return nn.functional.mse_loss(out, batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = TensorDataset(torch.randn(16, DIM), torch.randn(16, 1))
            return DataLoader(data, batch_size=4)

    def fit(callback, mode="ok", **kwargs) -> Any:
        net = Net(mode)
        options: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "max_steps": 1, "logger": False}
        options.update(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        options.update(num_sanity_val_steps=0)
        options.update(kwargs)
        trainer = lightning.Trainer(callbacks=[callback], **options)
        try:
            trainer.fit(net)
        finally:
            fit.real_steps = net.real_steps  # type: ignore[attr-defined]
        return trainer

    return fit


BAD_CALLBACK_ARGS = [
    ("target-zero", {"target_batch_size": 0}, "target_batch_size=0"),
    ("target-negative", {"target_batch_size": -32}, "target_batch_size=-32"),
    ("headroom-0.9", {"headroom": 0.9}, "headroom=0.9"),
    ("headroom-negative", {"headroom": -0.01}, "headroom=-0.01"),
    ("precision-unknown", {"precision": "fp8"}, "precision='fp8'"),
    ("device-blank", {"device": " "}, "device=' '"),
    ("log-dir-type", {"log_dir": 3}, "log_dir=3"),
]


@pytest.mark.parametrize(
    ("kwargs", "quoted"), [c[1:] for c in BAD_CALLBACK_ARGS], ids=[c[0] for c in BAD_CALLBACK_ARGS]
)
def test_callback_constructor_refuses_bad_input(kwargs, quoted):
    pytest.importorskip("lightning.pytorch")
    from resource_guard.frontdoors.lightning.callback import ResourceGuard

    with pytest.raises(ConfigurationError) as info:
        ResourceGuard(**kwargs)
    assert f"ResourceGuard({quoted})" in str(info.value)


BAD_CALLBACK_FIT = [
    ("device-unknown", {"device": "tpu-v5"}, "ok", "tpu-v5"),
    ("loss-non-scalar", {}, "non-scalar", "not a scalar"),
    ("loss-no-grad", {}, "no-grad", "does not require grad"),
]


@pytest.mark.parametrize(
    ("kwargs", "mode", "words"), [c[1:] for c in BAD_CALLBACK_FIT], ids=[c[0] for c in BAD_CALLBACK_FIT]
)
def test_callback_refuses_bad_input_before_any_step(kwargs, mode, words):
    from resource_guard.frontdoors.lightning.callback import ResourceGuard

    fit = _lightning()
    with pytest.raises(ConfigurationError, match=words):
        fit(ResourceGuard(monitor=False, **kwargs), mode)
    assert fit.real_steps == 0  # type: ignore[attr-defined]


def test_callback_refuses_an_unwritable_log_dir_before_any_step(tmp_path):
    from resource_guard.frontdoors.lightning.callback import ResourceGuard

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fit = _lightning()
    callback = ResourceGuard(log_dir=blocker / "logs", profile=False)
    with pytest.raises(ConfigurationError, match=r"ResourceGuard\(log_dir=.*not writable"):
        fit(callback)
    assert fit.real_steps == 0  # type: ignore[attr-defined]
    assert callback.plan is None  # refused in `setup`, before planning


# ---------------------------------------------------------------------------------------------------
# resource-guard preflight: exit 2, one paragraph on stderr, no traceback

FACTORIES = """
import torch
from torch import nn


def good(batch_size=8):
    model = nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(batch_size, 8), _loss


def _loss(model, batch):
    return model(batch).square().mean()


def not_a_module():
    return "model", None, torch.randn(2, 8)


def empty_model():
    return nn.ReLU(), (lambda params: torch.optim.SGD(params, lr=0.1)), torch.randn(2, 8)


def non_scalar_loss():
    model = nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8)


def foreign_optimizer():
    model = nn.Linear(8, 2)
    return model, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), torch.randn(2, 8), _loss


def no_grad_loss():
    model = nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8), lambda m, b: b.sum()


def loss_not_callable():
    model = nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8), "mse"


def float64(batch_size=8):
    model = nn.Linear(8, 2).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(batch_size, 8).double(), _loss
"""

CATALOGS = {
    "malformed.yaml": "devices: [\n",
    "no-devices-key.yaml": "gpus: []\n",
    "missing-memory.yaml": "devices:\n  - name: lab\n    kind: cuda\n",
    "missing-name.yaml": "devices:\n  - kind: cuda\n    memory: 8GiB\n",
    "bad-kind.yaml": "devices:\n  - name: lab\n    kind: tpu\n    memory: 8GiB\n",
    "bad-memory.yaml": "devices:\n  - name: lab\n    kind: cuda\n    memory: lots\n",
    "zero-memory.yaml": "devices:\n  - name: lab\n    kind: cuda\n    memory: 0\n",
    "unknown-field.yaml": "devices:\n  - name: lab\n    kind: cuda\n    memory: 8GiB\n    colour: red\n",
    "entry-not-mapping.yaml": "devices:\n  - lab\n",
    "bf16-not-bool.yaml": "devices:\n  - name: lab\n    kind: cuda\n    memory: 8GiB\n    bf16: maybe\n",
}

BAD_CLI: list[tuple[str, list[str], str]] = [
    ("not-a-module", ["factories.py:not_a_module"], "torch.nn.Module"),
    ("empty-model", ["factories.py:empty_model"], "no parameters"),
    ("non-scalar-loss", ["factories.py:non_scalar_loss"], "not a scalar loss"),
    ("foreign-optimizer", ["factories.py:foreign_optimizer"], "not the model's"),
    ("no-grad-loss", ["factories.py:no_grad_loss"], "does not require grad"),
    ("loss-not-callable", ["factories.py:loss_not_callable"], "callable"),
    ("missing-factory", ["factories.py:nope"], "no callable 'nope'"),
    ("missing-file", ["nowhere.py:build"], "does not exist"),
    ("batch-size-zero", ["factories.py:good", "--batch-size", "0"], "--batch-size 0"),
    ("batch-size-negative", ["factories.py:good", "--batch-size", "-3"], "--batch-size -3"),
    ("batch-size-not-int", ["factories.py:good", "--batch-size", "many"], "invalid int value"),
    ("headroom-0.95", ["factories.py:good", "--headroom", "0.95"], "--headroom 0.95"),
    ("headroom-negative", ["factories.py:good", "--headroom", "-0.2"], "--headroom -0.2"),
    ("headroom-nan", ["factories.py:good", "--headroom", "nan"], "--headroom nan"),
    ("device-unknown", ["factories.py:good", "--device", "tpu-v5"], "tpu-v5"),
    ("precision-unknown", ["factories.py:good", "--precision", "fp8"], "fp8"),
    ("catalog-missing-file", ["factories.py:good", "--catalog", "nowhere.yaml"], "nowhere.yaml"),
    *[(f"catalog-{name[:-5]}", ["factories.py:good", "--catalog", name], name) for name in CATALOGS],
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "factories.py").write_text(textwrap.dedent(FACTORIES))
    for name, text in CATALOGS.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("argv", "words"), [c[1:] for c in BAD_CLI], ids=[c[0] for c in BAD_CLI])
def test_preflight_refuses_bad_input_with_exit_2_and_one_paragraph(workdir, capsys, argv, words):
    code = main(["preflight", *argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert words in err
    assert "Traceback" not in err + out
    message = err.strip()
    if "usage:" not in message:  # argparse prints its usage first; ours is a single paragraph
        assert "\n\n" not in message and message.startswith("resource-guard preflight: ")


@pytest.mark.parametrize("name", list(CATALOGS))
def test_load_catalog_names_the_file_and_the_problem(workdir, name):
    with pytest.raises(ConfigurationError) as info:
        load_catalog(workdir / name)
    assert name in str(info.value) and "catalog" in str(info.value)


def test_preflight_estimates_a_float64_model(workdir, capsys):
    assert main(["preflight", "factories.py:float64", "--device", "cpu", "--json"]) == 0
    assert '"method": "traced"' in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# unusual but valid input: float64 models and batches of every common shape


def _close_to_real(model: nn.Module, optimizer: Any, batch: Any, loss_fn: Any, precision: str = "32-true"):
    est = estimate_memory(model, optimizer, batch, loss_fn, precision=precision, device="cpu")
    twin = copy.deepcopy(model)
    real = measure_reference(
        est, twin, optimizer(list(twin.parameters())), batch, loss_fn, precision=precision
    )
    assert est.method == "traced"
    assert abs(est.peak_bytes - real.peak_bytes) <= max(0.02 * real.peak_bytes, 4096), (est, real)
    return est, real


@pytest.mark.cpu_reference
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_float64_model_is_estimated_honestly(precision):
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)).double()
    batch = torch.randn(16, 32, dtype=torch.float64)
    est, real = _close_to_real(model, torch.optim.Adam, batch, _loss, precision)
    assert est.breakdown["parameters"] == sum(p.numel() * 8 for p in model.parameters())


NT = collections.namedtuple("NT", "x y")


@dataclasses.dataclass
class DC:
    x: torch.Tensor
    y: torch.Tensor
    tag: str = "train"


class KwNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _model()

    def forward(self, x: torch.Tensor, y: torch.Tensor, **extra: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(self.body(x), y)


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, DIM, generator=g), torch.randint(0, 3, (ROWS,), generator=g)


def _ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    body = model.body if isinstance(model, KwNet) else model
    return nn.functional.cross_entropy(body(x), y)


BATCH_SHAPES: list[tuple[str, Any, Any]] = [
    ("tensor", lambda x, y: x, lambda m, b: m.body(b).square().mean()),
    ("tuple", lambda x, y: (x, y), None),
    ("list", lambda x, y: [x, y], None),
    ("dict", lambda x, y: {"x": x, "y": y}, None),
    ("dict-with-non-tensors", lambda x, y: {"x": x, "y": y, "name": "b0", "epoch": 3, "w": None}, None),
    ("namedtuple", lambda x, y: NT(x, y), lambda m, b: _ce(m, b.x, b.y)),
    ("dataclass", lambda x, y: DC(x, y), lambda m, b: _ce(m, b.x, b.y)),
    (
        "nested",
        lambda x, y: {
            "inputs": (x, {"scale": torch.tensor(2.0), "ids": list(range(3))}),
            "targets": [y],
            "s": "x",
        },
        lambda m, b: _ce(m, b["inputs"][0], b["targets"][0]) * b["inputs"][1]["scale"],
    ),
]


@pytest.mark.cpu_reference
@pytest.mark.parametrize(("make", "loss_fn"), [c[1:] for c in BATCH_SHAPES], ids=[c[0] for c in BATCH_SHAPES])
def test_every_batch_shape_is_estimated_like_a_real_step(make, loss_fn):
    est, _ = _close_to_real(KwNet(), torch.optim.AdamW, make(*_xy()), loss_fn)
    assert est.batch_size == ROWS


@pytest.mark.parametrize(("make", "loss_fn"), [c[1:] for c in BATCH_SHAPES], ids=[c[0] for c in BATCH_SHAPES])
def test_every_batch_shape_splits_into_micro_batches_of_the_same_shape(make, loss_fn):
    batch = make(*_xy())
    parts = split_batch(batch, 5)
    assert [type(p) for p in parts] == [type(batch)] * 3
    assert [batch_size_of(p) for p in parts] == [5, 5, 2]
    rows = torch.cat([iter_tensors(p)[0] for p in parts])
    assert torch.equal(rows, iter_tensors(batch)[0])
    if isinstance(batch, dict) and "name" in batch:
        assert all(p["name"] == "b0" and p["epoch"] == 3 and p["w"] is None for p in parts)
    if isinstance(batch, DC):
        assert all(p.tag == "train" for p in parts)


@pytest.mark.parametrize(("make", "loss_fn"), [c[1:] for c in BATCH_SHAPES], ids=[c[0] for c in BATCH_SHAPES])
def test_every_batch_shape_trains_through_guard_in_micro_batches(monkeypatch, make, loss_fn):
    import resource_guard.planning.planner as planner

    real_plan = planner.plan

    def plan_micro_4(*args: Any, **kwargs: Any) -> Any:  # the real plan, with micro-batches of 4
        made = real_plan(*args, **kwargs)
        return dataclasses.replace(made, micro_batch_size=4, accumulation_steps=made.target_batch_size // 4)

    monkeypatch.setattr(planner, "plan", plan_micro_4)
    model = KwNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = make(*_xy())
    seen = []
    with guard(model, optimizer, loss_fn=loss_fn, device="cpu", monitor=False) as g:
        for micro in g.iterate([batch, batch]):
            seen.append((type(micro), batch_size_of(micro)))
            with g.autocast():
                loss = (loss_fn or (lambda m, b: m(**b) if isinstance(b, dict) else m(*b)))(model, micro)
            g.backward(loss)
    assert seen == [(type(batch), 4)] * 6 and g.optimizer_steps == 2
    assert g.plan is not None and g.plan.estimate.method == "traced"


def test_bad_input_counts():
    """The number of bad inputs tried here (reported in the reliability notes)."""
    counts = {
        "estimate_memory": len(BAD_CORE),
        "plan": len(BAD_CORE) + len(BAD_PLAN_ONLY),
        "guard": len(BAD_GUARD) + len(BAD_GUARD_ENTER) + 1,
        "ResourceGuard": len(BAD_CALLBACK_ARGS) + len(BAD_CALLBACK_FIT) + 1,
        "preflight": len(BAD_CLI),
        "load_catalog": len(CATALOGS),
    }
    assert sum(counts.values()) >= 100, counts
