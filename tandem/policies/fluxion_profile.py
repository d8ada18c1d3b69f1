"""A calibration profile: one file holding what `policy="fluxion"` needs for one model.

Contents (a dict saved with `torch.save`, read back with `weights_only=True`):
    meta       model name, shapes (layers, query / KV heads, head_dim), the sinks and window it was measured with,
               the thresholds `taus`, the block sizes, the calibration set and how long it took
    static     per tau: bgt0 / k / streaming [layers, Hq] from the calibration's quantile budgets (the `static`
               mode and the bench's replayed profile), and the measured share of streaming heads
    predictor  per tau: the MLP's weights and the feature standardisation (`tandem.policies.fluxion_predictor`)
    metrics    held-out accuracy of the predictor per tau

The default model's profile ships inside the package (`default_profile_path`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

PROFILE_VERSION = 1
PROFILE_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "smollm2-135m-instruct.pt"


def default_profile_path() -> Path:
    return PROFILE_DIR / DEFAULT_PROFILE


@dataclass
class Profile:
    meta: dict
    static: dict  # tau (as a string key) -> {"bgt0", "k", "streaming", ...}
    predictor: dict  # tau key -> predictor state (may be empty: static only)
    metrics: dict
    path: str = ""

    @property
    def taus(self) -> tuple[float, ...]:
        return tuple(self.meta["taus"])

    def tau_key(self, tau: float) -> str:
        """The profile's key of threshold `tau`; ValueError naming the calibrated ones if it was not calibrated."""
        return tau_key(self.taus[self.tau_index(tau)])

    def tau_index(self, tau: float) -> int:
        """The position of threshold `tau` among the profile's; ValueError naming them if it was not calibrated."""
        for i, t in enumerate(self.taus):
            if abs(t - tau) <= 1e-9:
                return i
        raise ValueError(
            f"TandemConfig.fluxion.tau={tau!r} was not calibrated in the profile {self.path or '(in memory)'}: "
            f"allowed {', '.join(f'{t:g}' for t in self.taus)} (run `tandem calibrate --taus ...` for others)"
        )

    def check_model(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Refuse a profile calibrated on a model of other shapes."""
        meta = self.meta
        want = {"layers": num_layers, "q_heads": num_q_heads, "kv_heads": num_kv_heads, "head_dim": head_dim}
        have = {k: meta[k] for k in want}
        if have != want:
            raise ValueError(
                f"the fluxion profile {self.path or '(in memory)'} was calibrated on {meta.get('model', '?')} "
                f"({_shape_text(have)}), but this model has {_shape_text(want)}: run `tandem calibrate --model "
                "<this model> --out PROFILE` and pass "
                "TandemConfig(fluxion=FluxionConfig(profile=PROFILE)) (--profile on the command line)"
            )

    def check_hot_set(self, sink_tokens: int, window_tokens: int) -> None:
        """The budgets were measured with the profile's sinks and window on the device: fewer would make its
        streaming labels and budgets too small, so they are refused."""
        sinks, window = self.meta["sink_tokens"], self.meta["window_tokens"]
        if sink_tokens < sinks or window_tokens < window:
            raise ValueError(
                f"TandemConfig.sink_tokens={sink_tokens}, window_tokens={window_tokens}: the fluxion profile "
                f"{self.path or '(in memory)'} was calibrated with {sinks} sinks and a {window}-token window; "
                "allowed: at least those (or calibrate with yours: `tandem calibrate --sink-tokens/--window-tokens`)"
            )

    def save(self, path: str | Path) -> None:
        state = {
            "version": PROFILE_VERSION,
            "meta": self.meta,
            "static": self.static,
            "predictor": self.predictor,
            "metrics": self.metrics,
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, str(path))


def tau_key(tau: float) -> str:
    return f"{tau:g}"


def _shape_text(shape: dict) -> str:
    return (
        f"{shape['layers']} layers, {shape['q_heads']} query / {shape['kv_heads']} KV heads, "
        f"head_dim {shape['head_dim']}"
    )


def load_profile(path: str | Path | None) -> Profile:
    """Read a profile file (None: the default model's, shipped in the package); cached per path."""
    target = Path(path).expanduser().resolve() if path is not None else default_profile_path()
    return _load(str(target))


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Profile:
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"fluxion profile {path!r} does not exist: pass a file written by `tandem calibrate --out`, or leave "
            "profile unset for the default model's"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file
        raise ValueError(f"fluxion profile {path!r} is not a calibration profile: {err}") from None
    if not isinstance(state, dict) or state.get("version") != PROFILE_VERSION:
        raise ValueError(
            f"fluxion profile {path!r} is not a version-{PROFILE_VERSION} calibration profile: "
            "write it again with `tandem calibrate`"
        )
    return Profile(state["meta"], state["static"], state["predictor"], state["metrics"], path)
