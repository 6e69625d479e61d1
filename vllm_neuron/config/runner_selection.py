"""Which model runner serves a configuration: Model Runner V2 or V1 (pure; the seeds' rules).

Resolved once per engine, when the configuration is finalized, and exposed as
`EngineConfig.use_v2_model_runner`. `VLLM_USE_V2_MODEL_RUNNER` unset picks MRv2 unless the
configuration uses a feature MRv2 does not support; 0 forces MRv1; 1 forces MRv2 and only warns.
MoE and sliding-window models use MRv1 without the seeds' "does not yet support" line unless 1 forces
MRv2, where they start without the warning (the seeds' rules); `model_reason` gives the one info line
that says why such a model is on MRv1 (not one of the seeds' lines, so their troubleshooting still holds).
"""
from __future__ import annotations

from dataclasses import dataclass

V2_LOG_LINE = "Using the standalone V2 Neuron model runner."


@dataclass(frozen=True)
class RunnerChoice:
    use_v2: bool
    unsupported: tuple[str, ...]  # features of this configuration MRv2 does not support
    forced: bool | None  # the VLLM_USE_V2_MODEL_RUNNER value (None: unset)
    mrv1_model: bool = False  # an MoE or sliding-window model: MRv1 by default, without the seeds' line
    model_kind: str = ""  # "MoE", "sliding-window" or "MoE, sliding-window"

    def log_message(self) -> str | None:
        """The line the seeds document for this decision, or None when nothing is logged."""
        features = ", ".join(self.unsupported)
        if self.use_v2 and self.forced and self.unsupported:
            return (f"VLLM_USE_V2_MODEL_RUNNER=1 forces Neuron Model Runner V2 with unsupported features "
                    f"({features}); execution may fail.")
        if not self.use_v2 and self.forced is None and self.unsupported and not self.mrv1_model:
            return f"Neuron Model Runner V2 does not yet support {features}; using V1."
        return None

    def model_reason(self) -> str | None:
        """Why an MoE / sliding-window model runs on MRv1 (None when it does not, or was forced there)."""
        if self.use_v2 or self.forced is not None or not self.mrv1_model:
            return None
        return (f"Model Runner V1: {self.model_kind} models use MRv1 by default (MRv2 support for them is in "
                f"bring-up; VLLM_USE_V2_MODEL_RUNNER=1 runs them on MRv2)")


def mrv2_unsupported_features(*, cpu_sampling: bool, enforce_eager: bool, speculative: bool = False
                              ) -> tuple[str, ...]:
    """Features of a dense configuration that select MRv1 (the seeds' list, as far as we build it)."""
    out = []
    if speculative:
        out.append("speculative decoding")
    if cpu_sampling:
        out.append("CPU sampling (on_device_sampling_config=null)")
    if enforce_eager:
        out.append("eager execution (enforce_eager)")
    return tuple(out)


def select_model_runner(env_value: bool | None, *, cpu_sampling: bool, enforce_eager: bool,
                        speculative: bool = False, moe: bool = False, sliding_window: bool = False) -> RunnerChoice:
    unsupported = mrv2_unsupported_features(cpu_sampling=cpu_sampling, enforce_eager=enforce_eager,
                                            speculative=speculative)
    mrv1_model = moe or sliding_window
    kind = ", ".join(k for k, on in (("MoE", moe), ("sliding-window", sliding_window)) if on)
    if env_value is None:
        return RunnerChoice(not unsupported and not mrv1_model, unsupported, None, mrv1_model, kind)
    return RunnerChoice(env_value, unsupported, env_value, mrv1_model, kind)
