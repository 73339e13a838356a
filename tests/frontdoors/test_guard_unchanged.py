"""The guard around an unchanged loop: ``with guard(model, optimizer):`` and no other line changed
(:mod:`resource_guard.frontdoors.guard.observed`). Real CPU loops of tiny models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from resource_guard import DoesNotFitError, guard
from resource_guard.errors import ConfigurationError, ResourceGuardWarning

VOCAB, WIDTH, SEQ = 64, 32, 16


class TinyGPT(nn.Module):
    """nanoGPT's interface: ``logits, loss = model(idx, targets)``; dropout draws from the global RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(0.1))
        self.proj = nn.Linear(4 * WIDTH, WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.calls = 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        self.calls += 1
        x = self.wte(idx)
        logits = self.lm_head(x + self.proj(self.mlp(x)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def get_batch(g: torch.Generator, batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def nanogpt_loop(
    model: TinyGPT, optimizer: torch.optim.Optimizer, steps: int, accumulation: int
) -> list[float]:
    """nanoGPT's train.py, in small: its own gradient accumulation, the next batch fetched mid-step."""
    g = torch.Generator().manual_seed(1)
    losses = []
    X, Y = get_batch(g)
    for _ in range(steps):
        for _ in range(accumulation):
            logits, loss = model(X, Y)
            loss = loss / accumulation
            X, Y = get_batch(g)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * accumulation)
    return losses


def fresh() -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_unchanged_loop_is_planned_timed_and_reported(tmp_path: Path) -> None:
    model, optimizer = fresh()
    with guard(model, optimizer, log_dir=tmp_path, profile=False) as g:
        nanogpt_loop(model, optimizer, steps=5, accumulation=3)
    assert g.optimizer_steps == 5 and g.micro_steps == 15
    assert g.plan is not None and g.plan.precision == "32-true" and g.plan.micro_batch_size == 4
    summary = json.loads((tmp_path / "guard.json").read_text())
    observed = summary["observed"]
    assert (observed["optimizer_steps"], observed["forwards"], observed["accumulation"]) == (5, 15, 3)
    assert observed["samples_per_step"] == 12 and observed["watch_failed"] is False
    report = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert report["steps"] == 5
    assert any("accumulates 3 forward(s) a step" in note for note in report["notes"])
    phases = report["phases"]
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
    assert list(tmp_path.glob("events.out.tfevents.*")) and (tmp_path / "report.md").exists()


def test_the_loss_trajectory_is_the_unguarded_loops_bit_for_bit(tmp_path: Path) -> None:
    model, optimizer = fresh()
    torch.manual_seed(5)
    alone = nanogpt_loop(model, optimizer, steps=4, accumulation=2)
    model, optimizer = fresh()
    torch.manual_seed(5)
    with guard(model, optimizer, log_dir=tmp_path, profile=False):
        guarded = nanogpt_loop(model, optimizer, steps=4, accumulation=2)
    assert guarded == alone
    assert next(model.parameters()).dtype == torch.float32  # nothing changed the loop's precision


def test_a_first_forward_that_does_not_fit_stops_before_it_runs() -> None:
    model, optimizer = fresh()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DoesNotFitError, match="first forward, a batch of 4") as caught:
        with guard(model, optimizer, memory_limit="300KiB", monitor=False):
            nanogpt_loop(model, optimizer, steps=2, accumulation=1)
    assert model.calls == 0  # the forward never ran
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert caught.value.report is not None and caught.value.report.micro_batch_size < 4


def test_the_pre_flight_traces_the_loop_as_it_runs() -> None:
    """A model that returns ``(logits, loss)`` is traced with its own loss, not a stand-in."""
    model, optimizer = fresh()
    with guard(model, optimizer, monitor=False) as g:
        nanogpt_loop(model, optimizer, steps=1, accumulation=1)
    assert g.plan is not None
    assert not any("stand-in" in line for line in g.plan.reasons)
    assert any("unchanged loop" in line for line in g.plan.reasons)


def classifier_loop(
    model: nn.Module, optimizer: torch.optim.Optimizer, epochs: int, batches: int
) -> list[float]:
    """pytorch/examples' mnist shape: ``output = model(data); loss = F.nll_loss(output, target)`` and an
    evaluation pass under ``no_grad`` each epoch."""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(batches)]
    tests = []
    for _ in range(epochs):
        model.train()
        for x, y in data:
            optimizer.zero_grad()
            output = model(x)
            loss = F.nll_loss(F.log_softmax(output, dim=1), y)
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            tests.append(sum(F.cross_entropy(model(x), y).item() for x, y in data))
    return tests


def classifier() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_evaluation_forwards_are_not_training_steps(tmp_path: Path) -> None:
    model, optimizer = classifier()
    alone = classifier_loop(model, optimizer, epochs=2, batches=3)
    model, optimizer = classifier()
    with guard(model, optimizer, log_dir=tmp_path, profile=False) as g:
        guarded = classifier_loop(model, optimizer, epochs=2, batches=3)
    assert guarded == alone
    observed = json.loads((tmp_path / "guard.json").read_text())["observed"]
    assert (observed["optimizer_steps"], observed["forwards"], observed["eval_forwards"]) == (6, 6, 6)
    assert observed["accumulation"] == 1
    assert g.plan is not None and any("stand-in" in line for line in g.plan.reasons)  # logits only
    phases = json.loads((tmp_path / "report.json").read_text())["summary"]["phases"]
    assert phases["evaluation"] > 0


def test_a_closure_optimizer_counts_its_steps_and_closure_evaluations(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    with guard(model, optimizer, log_dir=tmp_path, profile=False) as g:
        for _ in range(3):  # the closure's step is traced (estimate/closure_step.py): no fallback
            optimizer.step(closure)
    assert g.plan is not None and g.plan.estimate.method == "traced"
    observed = json.loads((tmp_path / "guard.json").read_text())["observed"]
    assert observed["optimizer_steps"] == 3 and observed["forwards"] == 0 and observed["accumulation"] is None
    assert observed["closure_forwards"] >= 3
    assert g.plan is not None and g.plan.precision == "64-true"


def test_a_failing_hook_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    class Broken:
        current = "other"

        def switch(self, phase: str) -> str:
            raise RuntimeError("the clock broke")

    model, optimizer = fresh()
    torch.manual_seed(5)
    alone = nanogpt_loop(model, optimizer, steps=3, accumulation=2)
    model, optimizer = fresh()
    torch.manual_seed(5)
    with guard(model, optimizer, log_dir=tmp_path, profile=False) as g:
        model.register_forward_pre_hook(lambda *a: setattr(g._watch, "clock", Broken()))
        with pytest.warns(ResourceGuardWarning, match="watching the loop stopped") as caught:
            guarded = nanogpt_loop(model, optimizer, steps=3, accumulation=2)
    assert guarded == alone
    stopped = [w for w in caught if "watching the loop" in str(w.message)]
    assert len(stopped) == 1
    # located at the user's line that ran the hook (this file's loop), not inside resource_guard or torch
    assert Path(stopped[0].filename).name == Path(__file__).name
    assert json.loads((tmp_path / "guard.json").read_text())["observed"]["watch_failed"] is True


class BigVocab(nn.Module):
    """A language model whose logits are most of the step: nanoGPT's ``(logits, loss)`` interface."""

    def __init__(self, vocab: int = 4096, width: int = 32) -> None:
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU())
        self.proj = nn.Linear(4 * width, width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx)
        logits = self.lm_head(x + self.proj(self.block(x)))
        return logits, F.cross_entropy(logits.view(-1, self.vocab), targets.reshape(-1))


def real_loop_peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, X: Any, Y: Any) -> int:
    """The real CPU peak of one steady-state step of the loop as written (torch.profiler's memory records)."""
    import gc

    from resource_guard.estimate.host.measure import allocation_deltas, live_bytes, peak_of
    from resource_guard.estimate.host.quiet import quiet_profile

    logits, loss = model(X, Y)  # a first step: the optimizer state exists
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del logits, loss
    gc.collect()
    start = live_bytes(model, optimizer, (X, Y))
    with quiet_profile() as prof:
        logits, loss = model(X, Y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return start + peak_of(allocation_deltas(prof))


@pytest.mark.parametrize("keep_outputs", [True, False])
def test_the_plan_holds_the_outputs_the_loop_holds(keep_outputs: bool) -> None:
    """``logits, loss = model(X, Y)`` keeps the logits alive through backward: the guard's pre-flight
    (default) predicts the loop's real CPU peak; ``keep_outputs=False`` leaves out one logits tensor."""
    torch.manual_seed(0)
    model = BigVocab()
    optimizer = torch.optim.AdamW(model.parameters())
    X, Y = torch.randint(0, 4096, (4, 32)), torch.randint(0, 4096, (4, 32))
    with guard(model, optimizer, monitor=False, keep_outputs=keep_outputs) as g:
        model(X, Y)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert g.plan is not None
    predicted = g.plan.estimate.peak_bytes
    real = real_loop_peak_bytes(model, optimizer, X, Y)
    logits = 4 * 32 * 4096 * 4
    if keep_outputs:
        assert real <= predicted <= real * 1.02
    else:
        assert predicted == pytest.approx(real - logits, rel=0.02)


class LogitsOnly(BigVocab):
    """pytorch/examples' shape: the model returns logits, the loop computes the loss."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = self.wte(idx)
        return self.lm_head(x + self.proj(self.block(x)))


def test_a_guard_loss_fn_makes_the_traced_steps_one_forward() -> None:
    """``output = model(X); loss = crit(output, Y)`` with the loss described by ``loss_fn``: the pre-flight
    runs the model once, inside ``loss_fn``, as the loop does (a second forward for the model's own loss
    would hold a second set of activations), and predicts the loop's real peak within 2%, never under."""
    import gc

    from resource_guard.estimate.host.measure import allocation_deltas, live_bytes, peak_of
    from resource_guard.estimate.host.quiet import quiet_profile

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, X: Any, Y: Any) -> None:
        output = model(X)
        loss = F.cross_entropy(output.view(-1, 4096), Y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def loss_fn(m: nn.Module, inputs: Any) -> torch.Tensor:
        return F.cross_entropy(m(*inputs).view(-1, 4096), torch.zeros(inputs[0].numel(), dtype=torch.long))

    torch.manual_seed(0)
    model = LogitsOnly()
    optimizer = torch.optim.AdamW(model.parameters())
    X, Y = torch.randint(0, 4096, (4, 32)), torch.randint(0, 4096, (4, 32))
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with guard(model, optimizer, loss_fn=loss_fn, monitor=False) as g:
        step(model, optimizer, X, Y)
    assert g.plan is not None and len(forwards) == 2  # the traced step's one forward, then the loop's
    step(model, optimizer, X, Y)  # the optimizer state exists, as in the steady state the plan predicts
    gc.collect()
    start = live_bytes(model, optimizer, (X, Y))
    with quiet_profile() as prof:
        step(model, optimizer, X, Y)
    real = start + peak_of(allocation_deltas(prof))
    assert real <= g.plan.estimate.peak_bytes <= real * 1.02


def test_the_guard_keeps_the_loops_precision_unless_asked() -> None:
    from resource_guard.planning.planner import choose_precision

    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(4, 8), torch.randn(4, 2))
    with guard(model, optimizer, sample_batch=batch, device="cpu", monitor=False) as g:
        pass
    assert g.plan is not None and g.plan.precision == "32-true"
    said = [line for line in g.plan.reasons if line.startswith("precision ")]
    assert len(said) == 1 and "the loop's own" in said[0]  # not "as asked": nobody asked
    double = nn.Linear(8, 2).double()
    optimizer = torch.optim.SGD(double.parameters(), lr=0.1)
    batch64 = (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))
    with guard(double, optimizer, sample_batch=batch64, device="cpu", monitor=False) as g:
        pass
    assert g.plan is not None and g.plan.precision == "64-true"
    assert next(double.parameters()).dtype == torch.float64
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, optimizer, sample_batch=batch, device="cpu", precision="auto", monitor=False) as g:
        pass
    assert g.plan is not None and g.plan.precision == choose_precision(g.plan.device)[0]


def test_an_autocasting_unchanged_loop_is_planned_in_its_autocast() -> None:
    model, optimizer = fresh()
    with guard(model, optimizer, monitor=False) as g:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = model(*get_batch(torch.Generator().manual_seed(0)))
        loss.backward()
        optimizer.step()
    assert g.plan is not None and g.plan.precision == "bf16-mixed"
    said = [line for line in g.plan.reasons if line.startswith("precision ")]
    assert said == [
        "precision bf16-mixed: the loop's own (its autocast, else its parameters' dtype); "
        "`precision='auto'` lets the guard choose, a name sets it"
    ]


def accumulation_loop_peak_bytes(steps: int, accumulation: int) -> int:
    """The real CPU peak of ``nanogpt_loop`` as written on ``BigVocab`` (torch.profiler's memory records)."""
    import gc

    from resource_guard.estimate.host.measure import allocation_deltas, live_bytes, peak_of
    from resource_guard.estimate.host.quiet import quiet_profile

    model, optimizer = big_vocab()
    gc.collect()
    start = live_bytes(model, optimizer)
    with quiet_profile() as prof:
        nanogpt_loop(model, optimizer, steps, accumulation)  # type: ignore[arg-type]
    return start + peak_of(allocation_deltas(prof))


def big_vocab() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = BigVocab(vocab=VOCAB)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_the_loops_own_accumulation_is_predicted_with_its_gradients_allocated() -> None:
    """Micro-steps 2..k of the loop's own accumulation run with every gradient allocated: once the loop
    shows it (its second forward before a step), the plan is refitted for them, and the prediction is
    never below the loop's real peak (within 2%)."""
    real = accumulation_loop_peak_bytes(steps=2, accumulation=3)
    model, optimizer = big_vocab()
    with guard(model, optimizer, monitor=False) as g:
        nanogpt_loop(model, optimizer, steps=2, accumulation=3)  # type: ignore[arg-type]
    assert g.plan is not None
    first_step = g.plan.estimate.peak_bytes
    predicted = g.plan.fit.allocated_peak_bytes
    assert first_step < real <= predicted <= real * 1.02
    assert any("forward 2 of a step with the gradients allocated" in line for line in g.plan.reasons)
    assert g.summary()["observed"]["gradients_kept_from_forward"] == 2


def test_accumulation_that_does_not_fit_stops_before_its_second_forward() -> None:
    """A first micro-step that fits and later ones (gradients allocated) that do not: the guard stops
    the loop before the second forward runs, with the figures of both."""
    model, optimizer = big_vocab()
    with guard(model, optimizer, monitor=False) as g:
        nanogpt_loop(model, optimizer, steps=1, accumulation=1)  # type: ignore[arg-type]
    assert g.plan is not None
    first = g.plan.fit.allocated_peak_bytes
    later = g.plan.estimate.for_device(g.plan.device, headroom=0.1, gradients_kept=True).allocated_peak_bytes
    limit = int((first + later) / 2 / 0.9)  # between the two, headroom 0.1
    model, optimizer = big_vocab()
    calls: list[int] = []
    with pytest.raises(DoesNotFitError, match="forward 2 of a step with the gradients allocated"):
        with guard(model, optimizer, monitor=False, memory_limit=limit):
            # after the guard's own pre-hook, on this model only (the pre-flight traces a copy)
            model.register_forward_pre_hook(lambda m, _: calls.append(1) if m is model else None)
            nanogpt_loop(model, optimizer, steps=2, accumulation=2)  # type: ignore[arg-type]
    assert len(calls) == 1  # the first micro-step ran; the second never started


class Sequence(nn.Module):
    """pytorch/examples' time_sequence_prediction, small: float64 LSTM cells over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTMCell(1, 16)
        self.linear = nn.Linear(16, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(input.size(0), 16, dtype=torch.double)
        outputs = []
        for x in input.split(1, dim=1):
            h, c = self.lstm(x, (h, c))
            outputs.append(self.linear(h))
        return torch.cat(outputs, dim=1)


def lbfgs_loop(guarded: bool, steps: int = 4) -> tuple[list[float], Any, int]:
    """The LBFGS closure loop as the script writes it; its losses, the guard (or None), its real peak."""
    import gc

    from resource_guard.estimate.host.measure import allocation_deltas, live_bytes, peak_of
    from resource_guard.estimate.host.quiet import quiet_profile

    torch.manual_seed(0)
    model = Sequence().double()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.8, max_iter=5, history_size=4)
    data = torch.sin(torch.linspace(0, 6, 21, dtype=torch.double)[None, :] + torch.arange(8.0)[:, None] / 4)
    input, target = data[:, :-1], data[:, 1:]

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.mse_loss(model(input), target)
        loss.backward()
        return loss

    losses: list[float] = []
    g = guard(model, optimizer, monitor=False) if guarded else None
    gc.collect()
    start = live_bytes(model, optimizer, data)
    with g if g is not None else torch.enable_grad(), quiet_profile() as prof:
        for _ in range(steps):
            losses.append(float(optimizer.step(closure).detach()))
    return losses, g, start + peak_of(allocation_deltas(prof))


def test_an_lbfgs_loop_is_traced_with_its_history_and_left_alone() -> None:
    """The closure's step traced with LBFGS's history at its full size: never below the loop's real peak
    once the history is full (4 steps of 5 iterations, history 4), and the losses are the unguarded
    loop's, bit for bit."""
    alone, _, real = lbfgs_loop(guarded=False)
    guarded, g, _ = lbfgs_loop(guarded=True)
    assert guarded == alone
    assert g.plan is not None and g.plan.precision == "64-true"
    predicted = g.plan.fit.allocated_peak_bytes
    assert real <= predicted <= real * 1.02
    assert any("closure optimizer LBFGS" in w for w in g.plan.estimate.warnings)
    # the closure's mse_loss keeps its (8, 20) float64 buffer: seen after the first step, held 3 times
    assert any("returns a loss on 1,280 bytes of storage" in r for r in g.plan.reasons)


def test_the_losses_a_closure_step_holds_are_checked_before_the_next_forward() -> None:
    """A closure loop that fits with the stand-in's loss but not with the losses LBFGS really holds:
    the guard stops it after its first step, before the next step's first forward runs."""
    _, g, _ = lbfgs_loop(guarded=True, steps=1)
    after = g.plan.fit.allocated_peak_bytes
    before = after - 3 * 1280  # the refit added three losses of 1,280 bytes
    limit = int((before + after) / 2 / 0.9)
    torch.manual_seed(0)
    model = Sequence().double()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.8, max_iter=5, history_size=4)
    x, y = torch.randn(8, 20, dtype=torch.double), torch.randn(8, 20, dtype=torch.double)
    calls: list[int] = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    with pytest.raises(DoesNotFitError, match="holds up to 3 of them"):
        with guard(model, optimizer, monitor=False, memory_limit=limit):
            model.register_forward_pre_hook(lambda m, _: calls.append(1) if m is model else None)
            for _ in range(3):
                optimizer.step(closure)
    assert 1 <= len(calls) <= 5  # the first step's closures (max_iter 5) ran; no later one


def test_g_iterate_with_a_closure_optimizer_is_refused_before_any_step() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.LBFGS(model.parameters())
    data = [(torch.randn(4, 3), torch.randn(4, 1))]
    with pytest.raises(ConfigurationError, match=r"LBFGS steps with a closure.*optimizer.step\(closure\)"):
        with guard(model, optimizer, monitor=False) as g:
            for x, y in g.iterate(data):
                g.backward(F.mse_loss(model(x), y))
    assert g.optimizer_steps == 0


def test_a_later_larger_batch_that_does_not_fit_stops_before_its_forward() -> None:
    """An unchanged loop whose batches grow (a longer sequence later on): each new shape is checked
    against the plan before its forward runs; the first that does not fit stops the loop there."""
    model, optimizer = fresh()
    with guard(model, optimizer, monitor=False) as g:
        model(*get_batch(torch.Generator().manual_seed(0)))[1].backward()
        optimizer.step()
    assert g.plan is not None
    small = g.plan.fit.allocated_peak_bytes
    limit = int(small * 1.5 / 0.9)  # a batch of 4 fits, one of 32 does not (headroom 0.1)
    model, optimizer = fresh()
    calls: list[int] = []
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(
        DoesNotFitError, match=r"batch shape 32×16 .* micro-batch of 32 .* stopped before"
    ) as caught:
        with guard(model, optimizer, monitor=False, memory_limit=limit):
            model.register_forward_pre_hook(lambda m, _: calls.append(1) if m is model else None)
            for batch_size in (4, 4, 32):
                _, loss = model(*get_batch(gen, batch_size))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    assert len(calls) == 2  # the two batches of 4 ran; the batch of 32 never started
    assert caught.value.report is not None


def test_a_later_batch_of_a_known_shape_is_not_traced_again() -> None:
    model, optimizer = fresh()
    gen = torch.Generator().manual_seed(0)
    with guard(model, optimizer, monitor=False) as g:
        for batch_size in (4, 4, 2, 4, 2):
            _, loss = model(*get_batch(gen, batch_size))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert g.optimizer_steps == 5
    shapes = g.summary().get("shapes") or {}
    assert shapes.get("batches_checked") == 4 and shapes.get("shapes_seen") == 2
