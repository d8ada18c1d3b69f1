"""`TandemConfig`: every knob of the cache and of hybrid attention, validated in one place."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import asdict, dataclass, fields

POLICIES = ("certified", "full", "streaming", "hgca", "quest", "fluxion")
HOST_DTYPES = ("int8", "fp8")  # the compressed host tier's formats (None: the model's dtype)
CERTIFY_BOUNDS = ("sketch", "digest")
CERTIFY_UNITS = ("row", "block")
# policy="certified" without an epsilon: the bound that kept full attention's answers on held-out retrieval tasks
# (docs/certified.md, with the share of host rows it attends)
DEFAULT_EPSILON = 0.05
CERTIFYING_POLICIES = ("certified", "quest", "fluxion")  # those that take an epsilon
FLUXION_MODES = ("predictor", "static", "oracle")
FLUXION_GRANULARITIES = (16, 32, 64, 128)
# quest's device share with the hot tier on CUDA: the share measured fastest at the 8B shape on an H100 and an H200
# (docs/engine.md § Quest, "Why 0.4")
MAX_WINDOW_TOKENS = 1 << 22  # far past any model context: a window past the model's own is refused per model
DEFAULT_GPU_SHARE = 0.4
# how quest's selected host blocks are split between the compute device and the CPU (`TandemConfig.scheduler`)
SCHEDULERS = ("share", "queue", "cpu", "heads", "volume")
# how tensor-parallel ranks divide the host tier and its CPU attention (`TandemConfig.host_split`)
HOST_SPLITS = ("heads", "requests")
HOST_SPLIT_POLICIES = ("full", "streaming", "quest")  # those host_split="requests" supports
# quest's recall cache with a device share on CUDA, in multiples of the budget: what it saves and costs in GPU
# memory is in docs/engine.md § Quest ("The recall cache")
DEFAULT_GPU_CACHE = 4.0


CPU_THREADS_ENV = "TANDEM_CPU_THREADS"  # set by a tensor-parallel rank for its share of the cores
ENGINE_CHOICES = ("auto", "on", "off")  # `--engine` of generate and eval: Tandem's engine, or model.generate


def uses_engine(choice: str, device_type: str) -> bool:
    """Whether an `--engine` choice decodes through Tandem's engine on a device of `device_type`: "on", or
    "auto" on CUDA (where its graph steps pay); "off" is model.generate."""
    if choice not in ENGINE_CHOICES:
        raise ValueError(f"engine must be one of {', '.join(ENGINE_CHOICES)}, got {choice!r}")
    return choice == "on" or (choice == "auto" and device_type == "cuda")


def default_cpu_threads(device: str = "auto") -> int:
    """$TANDEM_CPU_THREADS where set (a tensor-parallel rank's share, `distributed.launch`); else, for a cache on
    a GPU (`device` "cuda", or "auto" with CUDA present), all cores but one, which launches GPU work; else all
    cores: with the hot tier on the CPU nothing else runs while the CPU part does."""
    env = os.environ.get(CPU_THREADS_ENV, "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if device == "cpu" or (device == "auto" and not _cuda_present()):
        return cores
    return max(1, cores - 1)


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_number(text: str) -> int | float:
    """A command-line value of a numeric field: "256" -> 256, "0.25" -> 0.25; ValueError otherwise."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None


def _fail(name: str, value, allowed: str) -> None:
    raise ValueError(f"TandemConfig.{name}={value!r} is out of range: allowed {allowed}")


def _fail_type(name: str, value, allowed: str) -> None:
    raise ValueError(
        f"TandemConfig.{name}={value!r} has the wrong type ({type(value).__name__}): allowed {allowed}"
    )


@dataclass
class TandemConfig:
    """Configuration of a Tandem cache.

    Attributes:
        policy: which offloaded (host) entries each head attends during decode: `certified` (the default: quest's
            selection with `epsilon`, DEFAULT_EPSILON unless set: each query head keeps the fewest host rows whose
            skipped attention is provably at most epsilon of its attention; with the hot tier on the CPU it attends
            every host row, which costs less there than selecting), `full` (all), `streaming`
            (none: sinks + window only), `hgca` (moving-average attention weight above `beta / n`, per head),
            `quest` (top `budget` fraction of blocks by the min/max key bound, per KV head), `fluxion` (per-head
            budgets that keep each head's output within `tau` of full attention, streaming heads skipped, the
            block size chosen per GQA group; from a calibration `profile`).
        sink_tokens: first tokens of every sequence kept on the compute device for good.
        window_tokens: recent tokens kept on the compute device. An int is a token count; a float in (0, 1)
            is a fraction of the first prompt's length (at least one block).
        block_size: tokens per block: the unit of eviction and of the `quest` key digests.
        budget: for `quest`, the fraction of offloaded entries a KV head attends, in (0, 1], rounded up to whole
            blocks (so at a few dozen host blocks it reads more than `budget`; stats report the real fraction).
        beta: for `hgca`, the salience threshold factor (entries with MAW > beta / n are attended).
        maw_alpha: for `hgca`, weight of the newest step in the moving average of attention weights.
        span: for `hgca`, each salient entry also keeps the `span - 1` entries after it (1 = the paper's rule).
            Decoding copies forward from what it attends (a number, a name), and those successors get little
            attention before they are needed; measured on the default model in docs/architecture.md.
        observation_tokens: for `hgca`, how many final prompt tokens score the prompt's entries after a
            prefill or append (their mean attention weight starts each entry's MAW).
        prefill_chunk: query tokens per chunk of a prefill/append, so no full attention matrix is built.
        cpu_threads: threads for CPU attention (default: all cores but one with the hot tier on a GPU, all cores with
            it on the CPU; `default_cpu_threads`).
        gpu_share: for `quest`, the fraction of each step's selected host blocks that the compute device attends
            itself, reading them from pinned host memory over PCIe (zero-copy) while the CPU attends the rest
            (Fluxion's CPU+GPU split), in [0, 1]; 0 = the CPU reads everything. None (default): DEFAULT_GPU_SHARE
            for `quest` with the hot tier on a CUDA device, else 0. The best value depends on the host's memory
            and PCIe bandwidths: `tandem bench --set quest.gpu_share=0,0.3,0.5` measures it.
        gpu_cache: for `quest` with a device share, a cache on the compute device of recently selected host blocks
            (PNM-KV's steady blocks), sized as a multiple of the step's budget: `ceil(gpu_cache * k)` blocks per KV
            head for `k` selected ones (at least `k` plus the device share). A selected block found there is
            attended from device memory; the device's share of the others is copied in as it is read, replacing
            blocks not selected lately (a clock); the CPU attends the rest. The selection and the result are
            those of `quest` without it; only where each block is read from changes. None (default):
            DEFAULT_GPU_CACHE with a device share on CUDA, else 0 (off); on CUDA shrunk, with a warning, where the
            layers' caches together would take more than half the device's free memory (`cache.recall.RecallBudget`).
            It costs `gpu_cache * budget` of the host tier's bytes in device memory; a size set here is kept, and a
            `MemoryError` names it if it does not fit.
        scheduler: for `quest`, how each step's selected host blocks are split between the compute device and the
            CPU (`tandem.attention.queue`): "share" (default): the device attends `gpu_share` of every (request,
            KV head) segment's blocks, with the recall cache; "queue": Fluxion's priority queue: the segments,
            cut into pieces and listed largest first, are taken by the device from the front and the CPU from the
            back until none is left, so the split follows each side's speed with no tuning (no recall cache);
            "cpu": the CPU attends everything; "heads": the device takes `gpu_share` of the segments whole
            (uniform by heads); "volume": the device takes whole segments, largest first, up to `gpu_share` of
            the blocks (length-based). The last three are the static baselines of `benchmarks/bench_scheduler.py`.
        host_split: with tensor parallelism over several GPUs (`tandem.distributed`), how the ranks divide the
            host tier and its CPU attention: "heads" (default) as the GPUs divide the model, each rank its heads
            of every request; "requests": PnG-KV's DP mapping, each rank every head of its own requests, with an
            all-to-all of the queries and of the partial outputs per layer (`cache.split`). "requests"
            supports the policies full, streaming and quest, with no device share (gpu_share None or 0), no
            `host_dtype` and no `epsilon`; on one GPU both are the same.
        device: where the hot tier lives: "auto" (the model's device), "cpu", "cuda" or "cuda:N".
        tau: for `fluxion`, the attention-output error each head may keep (Fluxion Eq. 2): its output may
            differ from full attention's by `tau` times the layer's largest head output. 0, or one of the
            profile's calibrated values (0.02, 0.05, 0.1, 0.2 in the shipped one); 0 attends everything.
        profile: for `fluxion`, the calibration profile file (`tandem calibrate --out`); None: the one shipped for
            the default model. A profile of a model with other shapes is refused.
        fluxion_mode: for `fluxion`, where each step's per-head (bgt0, k, streaming) come from: "predictor" (the
            profile's MLP over 41 features of the step) or "static" (the profile's calibrated per-head values);
            "oracle" measures each step's exact Eq. 2 budgets over every host entry, with no profile: it reads
            the whole host tier each step, an analysis mode that separates the budget rule from the predictor.
        granularity: for `fluxion`, a fixed logical block size (16, 32, 64 or 128) instead of each GQA group's
            Eq. 3 choice (None, the default); an ablation.
        skip_streaming: for `fluxion`, streaming heads select nothing (True, default); False gives every head
            its Eq. 1 budget (an ablation).
        host_dtype: how the host tier stores K/V: None (default) in the model's dtype; "int8" or "fp8" (e4m3) as
            8-bit codes with one float32 scale per block of `block_size` rows and KV head, half the host memory
            and half the bytes each step reads from it (the CPU kernels and the GPU's reads decode in registers;
            quest's digests are taken before quantizing and stay exact). With it, `full` no longer equals dense
            attention: the rows it reads are the quantized ones. Its quality cost is measured in docs/evaluation.md.
        epsilon: certified selection, for `certified`, `quest` and `fluxion`. With quest (and `certified`, which
            is quest with it) it replaces the fixed `budget`: each step, every query head keeps the fewest of its
            best host rows or blocks (`certify_unit`; ranked by a sound upper bound of their attention mass) for
            which the mass it skips provably stays at most `epsilon` of its attention (`policies.certify`). With
            fluxion its own selection comes first and the certificate adds rows only to the heads it leaves above
            `epsilon`. In (0, 1); None (default): no certificate, except with `certified` (DEFAULT_EPSILON). Needs
            the host tier in the model's dtype (no `host_dtype`) and no device share (gpu_share None or 0).
            `cache.stats()` reports the certificate of every step.
        max_budget: with `epsilon`, the most of a head's host rows (or blocks) one step may keep, in (0, 1]
            (fluxion's own selection is kept even past it): the cost stays bounded, and a step where it binds is
            reported as not meeting `epsilon`, with its certified bound.
        certify_bound: with `epsilon`, the upper bound of the skipped logits: "sketch" (default) per row, from
            an int8 sketch of each host key and its error radius (q.k <= q.k~ + ||q|| ||k - k~||), kept beside
            the host tier on the compute device; "digest" per block, from Quest's key min / max and a centre +
            radius digest (many times looser on real keys: docs/certified.md). Both are sound.
        certify_unit: with `epsilon`, what the certified selection keeps: "row" the fewest host rows, ranked by
            their own bounds, so a block with one heavy row costs one row, not `block_size` (needs the "sketch"
            bound); "block" whole blocks of `block_size` rows, ranked by their blocks' bounds. None (default):
            "row" with the sketch bound, "block" with the digest bound.
        huge_pages: back the host tier with transparent huge pages where Linux allows it (THP "always" or
            "madvise"): the decode step's scattered block reads then miss the TLB less (the CPU kernel measured
            13% faster in isolation, whole steps 0-5%) and pinned stores allocate ~3x faster
            (`tandem.cache.memory`). False: plain (pinned) allocations.

    Example:
        >>> cfg = TandemConfig(policy="quest", budget=0.05, window_tokens=512)
        >>> cfg.block_size
        16
    """

    policy: str = "certified"
    sink_tokens: int = 64
    window_tokens: int | float = 256
    block_size: int = 16
    budget: float = 0.05
    beta: float = 1.0
    maw_alpha: float = 0.1
    span: int = 8
    observation_tokens: int = 32
    prefill_chunk: int = 2048
    cpu_threads: int | None = None
    gpu_share: float | None = None
    gpu_cache: float | None = None
    scheduler: str = "share"
    host_split: str = "heads"
    device: str = "auto"
    huge_pages: bool = True
    host_dtype: str | None = None
    tau: float = 0.1
    profile: str | None = None
    fluxion_mode: str = "predictor"
    granularity: int | None = None
    skip_streaming: bool = True
    epsilon: float | None = None
    max_budget: float = 0.5
    certify_bound: str = "sketch"
    certify_unit: str | None = None

    def __setattr__(self, name: str, value) -> None:
        """A field assigned after construction is checked like the constructor's: the whole config is validated
        again, and an invalid value is refused (the old one stays)."""
        state = self.__dict__
        if not state.get("_ready") or state.get("_validating") or name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name not in state:
            raise AttributeError(
                f"TandemConfig has no field {name!r}: allowed {', '.join(f.name for f in fields(self))}"
            )
        old = state[name]
        object.__setattr__(self, name, value)
        try:
            self._validate()
        except ValueError:
            object.__setattr__(self, name, old)
            raise

    def __post_init__(self) -> None:
        self._validate()
        object.__setattr__(self, "_ready", True)

    def _validate(self) -> None:
        object.__setattr__(self, "_validating", True)
        try:
            self._check_fields()
        finally:
            object.__setattr__(self, "_validating", False)

    def _check_fields(self) -> None:
        if self.policy not in POLICIES:
            _fail("policy", self.policy, "one of " + ", ".join(POLICIES))
        self._check_int("sink_tokens", 0, 1 << 20)
        if isinstance(self.window_tokens, bool) or not isinstance(self.window_tokens, numbers.Real):
            _fail_type("window_tokens", self.window_tokens, "an int >= 1 or a float fraction in (0, 1)")
        if isinstance(self.window_tokens, numbers.Integral):
            self.window_tokens = int(self.window_tokens)
        else:
            self.window_tokens = float(self.window_tokens)
        if isinstance(self.window_tokens, float):
            if not 0.0 < self.window_tokens < 1.0:
                _fail("window_tokens", self.window_tokens, "an int >= 1 or a float fraction in (0, 1)")
        elif self.window_tokens < 1:
            _fail("window_tokens", self.window_tokens, "an int >= 1 or a float fraction in (0, 1)")
        if isinstance(self.window_tokens, numbers.Integral) and self.window_tokens > MAX_WINDOW_TOKENS:
            _fail(
                "window_tokens",
                self.window_tokens,
                f"an int in [1, {MAX_WINDOW_TOKENS}] or a float fraction in (0, 1)",
            )
        self._check_int("block_size", 1, 4096)
        self._check_float("budget", 0.0, 1.0, "(0, 1]", low_open=True)
        self._check_float("beta", 0.0, math.inf, "(0, inf)", low_open=True)
        self._check_float("maw_alpha", 0.0, 1.0, "(0, 1]", low_open=True)
        self._check_int("span", 1, 4096)
        self._check_int("observation_tokens", 1, 1 << 16)
        self._check_int("prefill_chunk", 1, 1 << 24)
        if self.cpu_threads is None:
            self.cpu_threads = default_cpu_threads(self.device)
        self._check_int("cpu_threads", 1, 4096)
        if self.gpu_share is not None:
            self._check_float("gpu_share", 0.0, 1.0, "None or a fraction in [0, 1]", low_open=False)
        if self.gpu_share and self.policy != "quest":
            _fail(
                "gpu_share",
                self.gpu_share,
                "0 unless policy='quest' (the split needs block ids ranked on the device)",
            )
        if self.gpu_cache is not None:
            allowed = "None or a multiple of the budget in [0, 64] (0 = off)"
            self._check_float("gpu_cache", 0.0, 64.0, allowed, low_open=False)
        if self.gpu_cache and (self.policy != "quest" or self.gpu_share == 0):
            _fail(
                "gpu_cache",
                self.gpu_cache,
                "0 unless policy='quest' with a device share (gpu_share None or > 0): the cache is filled by it",
            )
        self._check_scheduler()
        self._check_host_split()
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda")
            or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        ):
            _fail("device", self.device, '"auto", "cpu", "cuda" or "cuda:N"')
        if self.huge_pages not in (True, False):  # 1 / 0 too: `--set quest.huge_pages=0,1`
            _fail("huge_pages", self.huge_pages, "True or False (1 or 0)")
        self.huge_pages = bool(self.huge_pages)
        if self.host_dtype is not None and not isinstance(self.host_dtype, str):
            _fail_type(
                "host_dtype",
                self.host_dtype,
                "None (the model's dtype), " + " or ".join(map(repr, HOST_DTYPES)),
            )
        if self.host_dtype is not None and self.host_dtype not in HOST_DTYPES:
            _fail(
                "host_dtype",
                self.host_dtype,
                "None (the model's dtype), " + " or ".join(map(repr, HOST_DTYPES)),
            )
        self._check_fluxion()
        self._check_epsilon()

    def _check_epsilon(self) -> None:
        self._check_float("max_budget", 0.0, 1.0, "a fraction in (0, 1]", low_open=True)
        if self.certify_bound not in CERTIFY_BOUNDS:
            _fail("certify_bound", self.certify_bound, " or ".join(map(repr, CERTIFY_BOUNDS)))
        if self.certify_unit is not None and self.certify_unit not in CERTIFY_UNITS:
            _fail("certify_unit", self.certify_unit, "None, " + " or ".join(map(repr, CERTIFY_UNITS)))
        if self.certify_unit == "row" and self.certify_bound != "sketch":
            _fail(
                "certify_unit",
                self.certify_unit,
                "None or 'block' with certify_bound='digest' (the digest bounds whole blocks; rows need the sketch)",
            )
        if self.epsilon is None and self.policy == "certified":
            self.epsilon = DEFAULT_EPSILON
        if self.epsilon is None:
            return
        self._check_float("epsilon", 0.0, 1.0, "None or a fraction in (0, 1)", low_open=True)
        if self.epsilon >= 1.0:
            _fail("epsilon", self.epsilon, "None or a fraction in (0, 1)")
        if self.policy not in CERTIFYING_POLICIES:
            _fail(
                "epsilon",
                self.epsilon,
                "None unless policy is 'certified', 'quest' or 'fluxion' (certified selection ranks their host rows)",
            )
        if self.host_dtype is not None and self.policy == "certified":
            _fail(
                "host_dtype",
                self.host_dtype,
                "None with policy='certified' (the default: its certificate bounds the exact keys, and 8-bit ones "
                "differ); an 8-bit host tier needs another policy, e.g. policy='quest'",
            )
        if self.host_dtype is not None:
            _fail(
                "epsilon",
                self.epsilon,
                "None with host_dtype set: the certificate bounds the stored keys, and 8-bit ones differ",
            )
        if self.gpu_share and self.policy == "certified":
            _fail(
                "gpu_share",
                self.gpu_share,
                "None or 0 with policy='certified' (the default: the device share splits one top-k by rank, and "
                "certified selections differ per head); a device share needs another policy, e.g. policy='quest'",
            )
        if self.gpu_share:
            _fail(
                "gpu_share",
                self.gpu_share,
                "None or 0 with epsilon (the device share splits one top-k by rank; certified selections differ per head)",
            )

    def _check_scheduler(self) -> None:
        if self.scheduler not in SCHEDULERS:
            _fail("scheduler", self.scheduler, ", ".join(f'"{name}"' for name in SCHEDULERS))
        if self.scheduler == "share":
            return
        if self.policy != "quest" or self.epsilon is not None:
            _fail(
                "scheduler",
                self.scheduler,
                "\"share\" unless policy='quest' without epsilon (the queue splits its top-k)",
            )
        if self.gpu_cache:
            _fail(
                "gpu_cache",
                self.gpu_cache,
                f"None or 0 with scheduler={self.scheduler!r} (the recall cache is filled by the device share)",
            )
        if self.host_dtype is not None:
            _fail(
                "host_dtype",
                self.host_dtype,
                f"None with scheduler={self.scheduler!r} (the queue's GPU side reads the model's dtype only)",
            )
        if self.gpu_share is not None and self.scheduler in ("queue", "cpu"):
            _fail(
                "gpu_share", self.gpu_share, f"None with scheduler={self.scheduler!r} (it sets no fraction)"
            )

    def _check_host_split(self) -> None:
        if self.host_split not in HOST_SPLITS:
            _fail("host_split", self.host_split, " or ".join(f'"{name}"' for name in HOST_SPLITS))
        if self.host_split == "heads":
            return
        if self.policy not in HOST_SPLIT_POLICIES:
            supported = ", ".join(HOST_SPLIT_POLICIES)
            _fail(
                "host_split",
                self.host_split,
                f'"heads" with policy={self.policy!r} ("requests" supports {supported})',
            )
        unread = "(a rank's host tier holds other ranks' heads, which its GPU does not read)"
        unsupported = "(the split moves K/V in the model's dtype and no per-row bounds)"
        for name, allowed, why in (
            ("gpu_share", "None or 0", unread),
            ("gpu_cache", "None or 0", unread),
            ("host_dtype", "None", unsupported),
            ("epsilon", "None", unsupported),
        ):
            value = getattr(self, name)
            if value is not None and value != 0:
                _fail(name, value, f"{allowed} with host_split='requests' {why}")
        if self.scheduler != "share":
            _fail("scheduler", self.scheduler, f"\"share\" with host_split='requests' {unread}")

    def queue_share(self) -> float:
        """The device's fraction under the static schedulers "heads" and "volume"."""
        return self.gpu_share if self.gpu_share is not None else DEFAULT_GPU_SHARE

    def _check_fluxion(self) -> None:
        self._check_float(
            "tau", 0.0, 1.0, "0 or a threshold in (0, 1) calibrated in the profile", low_open=False
        )
        if self.tau >= 1.0:
            _fail("tau", self.tau, "0 or a threshold in (0, 1) calibrated in the profile")
        if self.profile is not None and not isinstance(self.profile, (str, os.PathLike)):
            _fail("profile", self.profile, "None (the default model's profile) or a path to a profile file")
        if self.profile is not None:
            self.profile = os.fspath(self.profile)
        if self.fluxion_mode not in FLUXION_MODES:
            _fail("fluxion_mode", self.fluxion_mode, " or ".join(map(repr, FLUXION_MODES)))
        if self.granularity is not None and (
            isinstance(self.granularity, bool) or self.granularity not in FLUXION_GRANULARITIES
        ):
            _fail("granularity", self.granularity, "None (Eq. 3 per group) or one of 16, 32, 64, 128")
        if self.granularity is not None:
            self.granularity = int(self.granularity)
        if self.skip_streaming not in (True, False):
            _fail("skip_streaming", self.skip_streaming, "True or False (1 or 0)")
        self.skip_streaming = bool(self.skip_streaming)
        if self.policy == "fluxion" and self.block_size != 16:
            _fail(
                "block_size",
                self.block_size,
                "16 with policy='fluxion' (its logical blocks are 16-128 tokens)",
            )

    def _check_int(self, name: str, low: int, high: int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            _fail_type(name, value, f"an integer in [{low}, {high}]")
        if not low <= value <= high:
            _fail(name, value, f"an integer in [{low}, {high}]")
        setattr(self, name, int(value))  # a numpy integer becomes a Python int

    def _check_float(self, name: str, low: float, high: float, text: str, low_open: bool) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            _fail_type(name, value, text)
        ok = math.isfinite(value) and value <= high and (value > low if low_open else value >= low)
        if not ok:
            _fail(name, value, text)
        setattr(self, name, float(value))

    def gpu_share_on(self, device_type: str) -> float:
        """The device share in effect with the hot tier on a device of this type ("cuda", "cpu"): resolves the
        None default."""
        if self.scheduler != "share":
            return 0.0  # the queue splits the blocks (`tandem.attention.queue`)
        if self.host_split == "requests":
            return 0.0  # the device cannot read the other ranks' heads in this rank's host tier
        if self.gpu_share is not None:
            return self.gpu_share
        certified = self.epsilon is not None
        return (
            DEFAULT_GPU_SHARE if self.policy == "quest" and device_type == "cuda" and not certified else 0.0
        )

    def gpu_cache_on(self, device_type: str) -> float:
        """The recall cache's size in effect with the hot tier on a device of this type: resolves the None default
        (on with a device share on CUDA)."""
        if self.gpu_cache is not None:
            return self.gpu_cache
        return DEFAULT_GPU_CACHE if device_type == "cuda" and self.gpu_share_on(device_type) > 0 else 0.0

    def window_for_prompt(self, prompt_tokens: int) -> int:
        """Window size in tokens once the first prompt's length is known."""
        if isinstance(self.window_tokens, float):
            return max(self.block_size, math.ceil(self.window_tokens * prompt_tokens))
        return self.window_tokens

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
