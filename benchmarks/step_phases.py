"""Where an engine step's time goes, per phase, for ``benchmarks.step_profile --phases``.

:func:`instrument` wraps, on one ``LLM`` only and for the benchmark's lifetime, the calls that
bound each phase with ``perf_counter`` timers; nothing in the engine changes, so the normal
path pays nothing. Timers nest: a phase's time is its own time with the phases inside it taken
out (a linear called back from the native decode driver counts as a linear, not as the
driver). A step is "prefill" when any request computes more than one token in it (a chunk of
prompts, decode rows riding along), else "decode". Phases:

* ``scheduling``: ``Scheduler.schedule``; ``update``: ``Scheduler.update_from_output``;
* ``input preparation``: the runner's request copies (``requests.apply``) and ``build_inputs``;
* ``linears``: every ``nn.Linear`` but the LM head (prefill: the batched GEMM); ``LM head``:
  ``compute_logits``; ``sampling``: the runner's ``sample``;
* ``GDN``: ``gdn_mixer`` (conv + gates + delta rule; prefill: the chunked kernel);
  ``attention``: ``ForwardContext.attention`` (prefill: varlen prefill attention);
* ``native decode driver``: what ``decode_native.run`` spends outside the linears it calls
  back (the GDN recurrence, decode attention, norms, MLP activations; ``PAGEFOLD_NATIVE_DECODE=0``
  splits them into the phases above);
* ``rest of forward``: the rest of ``runner.execute`` (embedding, norms, activations, rotary,
  residual adds, page copies); ``rest of step``: the engine step outside all of these.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

KINDS = ("prefill", "decode")


class PhaseTimer:
    """Nested wall-clock timers; per step kind, each phase's self time and the step count."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, float]] = {k: defaultdict(float) for k in KINDS}
        self.steps: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._cur: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [phase, start, time of the phases inside]
        self.kind = "decode"

    def push(self, phase: str) -> None:
        self._stack.append([phase, time.perf_counter(), 0.0])

    def pop(self) -> None:
        phase, t0, inner = self._stack.pop()
        dt = time.perf_counter() - t0
        self._cur[phase] += dt - inner
        if self._stack:
            self._stack[-1][2] += dt

    def wrap(self, fn: Callable, phase: str) -> Callable:
        def timed(*args, **kwargs):
            self.push(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.pop()
        return timed

    def end_step(self) -> None:
        """Fold the step just timed (the outermost phase, ``step``) into its kind."""
        cur, self._cur = self._cur, defaultdict(float)
        tot = self.totals[self.kind]
        for phase, t in cur.items():
            tot["rest of step" if phase == "step" else phase] += t
        self.steps[self.kind] += 1

    def table(self) -> str:
        lines = []
        for kind in KINDS:
            tot, n = self.totals[kind], self.steps[kind]
            if not n:
                continue
            whole = sum(tot.values())
            lines.append(f"{kind} steps: {n}, {whole:.2f} s ({whole / n * 1e3:.1f} ms a step)")
            lines.append(f"  {'phase':<28} {'s':>8} {'ms/step':>9} {'share':>7}")
            for phase, t in sorted(tot.items(), key=lambda p: -p[1]):
                lines.append(f"  {phase:<28} {t:8.2f} {t / n * 1e3:9.2f} {t / whole:7.1%}")
        return "\n".join(lines)


def instrument(llm) -> PhaseTimer:
    """Wrap ``llm``'s engine (in-process, tensor parallel 1) with a :class:`PhaseTimer`."""
    import torch

    from pagefold.executor import forward_context, model_runner
    from pagefold.layers import decode_native
    from pagefold.ops import gdn

    timer = PhaseTimer()
    core = llm.engine
    runner, sched = core.runner, core.scheduler

    def schedule(*a, **k):
        out = sched_schedule(*a, **k)
        multi = any(n > 1 for n in out.num_scheduled.values())
        timer.kind = "prefill" if multi else "decode"
        return out

    sched_schedule = sched.schedule
    sched.schedule = timer.wrap(schedule, "scheduling")
    sched.update_from_output = timer.wrap(sched.update_from_output, "update")
    runner.requests.apply = timer.wrap(runner.requests.apply, "input preparation")
    runner.sample = timer.wrap(runner.sample, "sampling")
    runner.execute = timer.wrap(runner.execute, "rest of forward")
    runner.model.compute_logits = timer.wrap(runner.model.compute_logits, "LM head")
    model_runner.build_inputs = timer.wrap(model_runner.build_inputs, "input preparation")
    decode_native.run = timer.wrap(decode_native.run, "native decode driver")
    forward_context.ForwardContext.attention = timer.wrap(
        forward_context.ForwardContext.attention, "attention")
    for mod in _modules_calling(gdn.gdn_mixer):
        mod.gdn_mixer = timer.wrap(gdn.gdn_mixer, "GDN")
    for name, m in runner.model.named_modules():
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name:
            m.register_forward_pre_hook(lambda *_: timer.push("linears"))
            m.register_forward_hook(lambda *_: timer.pop())
    step = timer.wrap(core.step, "step")

    def one_step(*a, **k):
        try:
            return step(*a, **k)
        finally:
            timer.end_step()

    core.step = one_step
    return timer


def _modules_calling(fn: Callable) -> list:
    """The loaded pagefold modules that imported ``fn`` by name."""
    import sys

    return [m for name, m in list(sys.modules.items())
            if name.startswith("pagefold.") and getattr(m, fn.__name__, None) is fn
            and name != fn.__module__]
