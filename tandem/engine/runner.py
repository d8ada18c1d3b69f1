"""Prefill and decode loop over a `TandemCache` with low per-step overhead.

Prefill runs the model on `chunk_tokens` tokens at a time: each chunk's KV goes to the cache as it is made
(sinks and window on the GPU, the rest to pinned host memory), so a 128K-token prompt never holds more than
one chunk's activations on the GPU. Every chunk attends all earlier tokens exactly.

Decode steps have fixed addresses: the new token's hot-tier slot is a device tensor, and each layer's q / CPU
output / LSE live in fixed pinned buffers. That lets CUDA graphs hold a whole step, recorded once (`step.py`, which
owns the recording and the hand-offs between GPU and host): Tandem's own decode forward for the Llama family
(`forward.py`: concatenated projections, fused norms, RoPE and SiLU), or for other models their transformers code
with Tandem's registered attention (`forward="hf"`). Python per step is then the bookkeeping (slot, block
evictions) and one CPU part per layer. Each step chooses its tokens inside the step (greedy, or a `Sampler`'s
draw: temperature, top-p and seed per row, `sampling.py`). Without CUDA the same step runs eagerly;
`use_graphs=False` does that on CUDA too (still overlapped per layer).
"""

from __future__ import annotations

import contextlib
import platform
import sys
import time
import weakref

import torch

from ..cache.prefix import PrefixCache
from ..integrations.hf import TandemCache, generate_cache_kwargs, layer_windows
from ..kernels import gpu as gpu_kernels
from . import handoff as handoff_module
from .forward import DecodeForward, unsupported_reason
from .fused import FusedLayers
from .prefill import chunk_end, keep_prefix, observed_tokens, run_chunk, start_from_prefix
from .sampling import Sampler
from .step import DecodeStep, read_layout

HANDOFFS = ("auto", "memops", "launches")
FORWARDS = ("auto", "own", "hf")  # the decode step's layer code: Tandem's own (Llama family) or transformers'
WARMUP_TOKENS = 4096  # the longest prompt `TandemRunner.warm_up` runs


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def device_memory_error(err: BaseException, device: torch.device, during: str, levers: str) -> MemoryError:
    """A MemoryError for the allocator's out-of-memory on `device`: what ran out, how much is free, and what
    needs less. The cache that was filling refuses further use (`TandemCache.mark_failed`)."""
    free = ""
    if device.type == "cuda":
        with contextlib.suppress(RuntimeError):
            free_bytes, total_bytes = torch.cuda.mem_get_info(device)
            free = f" ({free_bytes / 2**30:.2f} of {total_bytes / 2**30:.1f} GiB free now)"
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return MemoryError(
        f"{device} ran out of memory during {during}{free}: {first_line}. The cache is left unusable: build a new "
        f"one. Needs less: {levers}"
    )


class StepOptions:
    """The engine's step options resolved for `model` (`TandemRunner`'s and `RowsRunner`'s arguments): whether
    steps are recorded as CUDA graphs, the hand-off, the fused norm / RoPE kernels, and whose layer code the
    decode step runs. Raises ValueError naming the argument and its allowed values."""

    def __init__(
        self, model, use_graphs="auto", handoff: str = "auto", fused="auto", forward: str = "auto"
    ) -> None:
        if use_graphs not in (True, False, "auto"):
            raise ValueError(f"use_graphs must be True, False or 'auto', got {use_graphs!r}")
        self.device = next(model.parameters()).device
        # a sliding-window layer's cache is not at fixed addresses yet: its steps run eagerly
        sliding = any(w is not None for w in layer_windows(model.config.get_text_config(decoder=True)))
        if use_graphs is True and sliding:
            raise ValueError(
                "use_graphs=True: the model has sliding-window layers, whose steps run eagerly; use "
                "use_graphs=False or 'auto'"
            )
        if use_graphs is True and self.device.type != "cuda":
            raise ValueError(f"use_graphs=True needs the model on a CUDA device; it is on {self.device}")
        self.use_graphs = self.device.type == "cuda" and not sliding if use_graphs == "auto" else use_graphs
        if handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {', '.join(HANDOFFS)}, got {handoff!r}")
        if handoff == "memops" and self.use_graphs and not handoff_module.available():
            raise ValueError(
                "handoff='memops' needs the CUDA driver's stream memory operations (libcuda.so.1); "
                "use handoff='launches'"
            )
        if handoff == "auto":
            # x86 keeps the host's stores in order, which the done flag relies on (set from Python, unfenced)
            x86 = platform.machine().lower() in ("x86_64", "amd64")
            handoff = "memops" if self.use_graphs and x86 and handoff_module.available() else "launches"
        self.handoff = handoff
        if fused not in (True, False, "auto"):
            raise ValueError(f"fused must be True, False or 'auto', got {fused!r}")
        can_fuse = gpu_kernels.triton_available(self.device)
        if fused is True and not can_fuse:
            raise ValueError(
                f"fused=True needs the Triton kernels on {self.device} (CUDA with triton installed, or Triton's "
                "interpreter on CPU); use fused=False"
            )
        use_fused = can_fuse and (fused is True or self.device.type == "cuda")
        # the model's RMSNorm / RoPE as one kernel each, during this runner's passes only
        self.fused_layers = FusedLayers(model, self.device) if use_fused else None
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")
        reason = unsupported_reason(model) if forward != "hf" else None
        if forward == "own" and reason is not None:
            raise ValueError(
                f"forward='own': Tandem's decode forward cannot run this model: {reason}; use forward='hf'"
            )
        if forward == "auto" and reason is not None:
            print(f"tandem: decoding with transformers' layer code ({reason})", file=sys.stderr)
        self.model = model
        self.kernels = "triton" if use_fused else "torch"
        # Tandem's own decode forward (Llama family), else transformers' layers with the attention registered
        self.forward = "own" if forward != "hf" and reason is None else "hf"

    def decoder(self, cache=None) -> DecodeForward | None:
        """Tandem's decode forward over `cache` (None: each step names its caches), or None with
        transformers' layers."""
        return DecodeForward(self.model, cache, kernels=self.kernels) if self.forward == "own" else None


class TandemRunner:
    """Chunked prefill and greedy decode of a Hugging Face causal LM over a `TandemCache`.

    Example:
        >>> from tandem import TandemCache, TandemConfig, load_model
        >>> from tandem.engine import TandemRunner
        >>> model, tok = load_model()
        >>> runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="quest")))
        >>> logits = runner.prefill(tok("The capital of France is", return_tensors="pt").input_ids)
        >>> tokens, seconds = runner.decode(logits.argmax(-1), steps=8)
    """

    def __init__(
        self,
        model,
        cache: TandemCache,
        use_graphs: bool | str = "auto",
        warmup_steps: int = 1,
        handoff: str = "auto",
        fused: bool | str = "auto",
        forward: str = "auto",
    ) -> None:
        if not isinstance(cache, TandemCache):
            raise ValueError(
                f"cache must be a TandemCache (TandemCache.for_model(model)), got {type(cache).__name__}"
            )
        self.model = model
        self.cache = cache
        options = StepOptions(model, use_graphs, handoff, fused, forward)
        self.device, self.use_graphs, self.handoff = options.device, options.use_graphs, options.handoff
        self.fused_layers, self.forward = options.fused_layers, options.forward
        self.decoder = options.decoder(cache)
        self.warmup_steps = max(1, warmup_steps)
        self.cache_kwargs = generate_cache_kwargs(model, cache)
        self.next_position: torch.Tensor | None = None  # [B] position of each request's next token
        self.prefill_seconds = 0.0
        # of the last prefill's prompt, the tokens taken from a kept prefix (`prefill`'s prefix_cache)
        self.reused_tokens = 0
        self.host_seconds: list[float] = []  # per decode step: seconds in the CPU parts
        # the decode step, its inputs and its recording, kept from one stream to the next (`_step_for`): a request
        # that follows another in this runner's cache (`warm_up`, `TandemCache.reset`) replays its recording
        self._step: DecodeStep | None = None
        self._step_key = None  # (batch, token chooser) the step was made for
        self._eager_left = 0  # eager steps before the step is recorded
        self.recordings = 0  # steps recorded (CUDA graphs), over the runner's life

    @property
    def layers(self):
        return self.cache.tandem_layers()

    # ---- prefill -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        input_ids,
        attention_mask=None,
        chunk_tokens: int = 8192,
        max_new_tokens: int = 0,
        append=False,
        prefix_cache: PrefixCache | None = None,
    ):
        """Run the prompt through the model `chunk_tokens` at a time; returns the last position's logits [B, V].

        input_ids: [B, T] int64 (left-padded for ragged batches); attention_mask: [B, T] (1 = token, 0 = pad).
        max_new_tokens sizes the host tier once for the prompt plus that many decode tokens.
        append: the tokens continue what the cache holds (a conversation's next turn after `generate`, `decode`
        or `stream`): no padding, positions from each row's next one on, every token attending everything cached
        exactly; the host tier grows where it must.
        prefix_cache: a batch-1 prompt without padding starts from the longest prefix of it kept there under this
        cache's settings and chunk length (`reused_tokens` says how many tokens), and keeps its own prefixes there
        at its last chunk boundaries (`cache.prefix`, `prefill.kept_ends`); the logits and the cache are those of
        a cold prefill.
        """
        held = self.cache.get_seq_length()
        if append and (not held or self.next_position is None):
            raise ValueError(
                "append continues a cache that this runner prefilled: call prefill() without append first"
            )
        if held and not append:
            raise ValueError(
                "prefill runs on an empty cache: for a new prompt, empty this one (runner.cache.reset(), which keeps "
                "its buffers and the runner's recording) or build a new TandemCache; to continue it, append=True"
            )
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be [batch, tokens] with tokens >= 1, got {tuple(input_ids.shape)}"
            )
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        input_ids = input_ids.to(self.device)
        batch, total = input_ids.shape
        if append:
            if attention_mask is not None:
                raise ValueError("append takes no attention_mask: a continuation has no padding")
            if batch != self.next_position.shape[0]:
                raise ValueError(
                    f"input_ids must continue each of the cache's {self.next_position.shape[0]} rows, got {batch}"
                )
            limit = self.cache.layers[0].max_positions
            if limit is not None and held + total + max_new_tokens > limit:
                raise ValueError(
                    f"the cache holds {held} tokens; {total} more and max_new_tokens={max_new_tokens} exceed the "
                    f"model's maximum of {limit} positions"
                )
            mask = None
            positions = self.next_position[:, None] + torch.arange(total, device=self.device)
        else:
            mask = (
                torch.ones_like(input_ids)
                if attention_mask is None
                else attention_mask.to(self.device).long()
            )
            if tuple(mask.shape) != (batch, total):
                raise ValueError(
                    f"attention_mask must be [batch, tokens] = {(batch, total)}, got {tuple(mask.shape)}"
                )
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
        for layer in self.layers:
            layer.capacity_hint = held + total + max_new_tokens
        start = time.perf_counter()
        self.reused_tokens = 0
        keep = None  # (store, the prompt's tokens) where the prompt keeps its prefixes
        if prefix_cache is not None and not append and batch == 1 and bool(mask.all()):
            keep = (prefix_cache, input_ids[0].tolist())
            self.reused_tokens = start_from_prefix(prefix_cache, self.cache, keep[1], chunk_tokens)
        try:
            with self.fused_layers or contextlib.nullcontext():
                logits = self._prefill_chunks(
                    input_ids, mask, positions, chunk_tokens, self.reused_tokens, keep
                )
        except BaseException as err:
            if isinstance(err, torch.OutOfMemoryError):
                raise device_memory_error(
                    err,
                    self.device,
                    f"prefill of {batch} x {total} tokens in chunks of {chunk_tokens}",
                    "a smaller chunk_tokens (tandem's --prefill-chunk), batch or prompt",
                ) from err
            raise
        self._sync()
        self.prefill_seconds = time.perf_counter() - start
        self.next_position = positions[:, -1] + 1
        return logits

    def _prefill_chunks(
        self, input_ids, mask, positions, chunk_tokens: int, start: int, keep
    ) -> torch.Tensor:
        """The chunks from `start` (a boundary: the tokens a restored prefix holds) to the end; `keep`: (store,
        tokens) to keep the prompt's prefixes in the store (`prefill.keep_prefix`), or None."""
        total = input_ids.shape[1]
        observed = observed_tokens(self.cache.config)
        while start < total:
            end = chunk_end(start, total, chunk_tokens, observed)
            logits = run_chunk(
                self.model, self.cache, self.cache_kwargs, input_ids[:, start:end], positions[:, start:end],
                mask[:, :end] if mask is not None else None, last=end == total,
            )  # fmt: skip
            if keep is not None:
                keep_prefix(keep[0], self.cache, keep[1], end, chunk_tokens)
            start = end
        return logits

    def set_positions(self, next_position: torch.Tensor) -> None:
        """Positions [B] of each request's next token, for a cache filled without `prefill` (benchmarks)."""
        if next_position.dim() != 1:
            raise ValueError(f"next_position must be [batch], got {tuple(next_position.shape)}")
        self.next_position = next_position.to(self.device, torch.long)

    # ---- warm-up -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, prompt_tokens: int, max_new_tokens: int = 0, steps: int | None = None) -> float:
        """Run one throwaway request through the runner's own cache, then empty it (`TandemCache.reset`), so that
        the process's one-time costs fall before the first real request: kernel builds (Triton's, from its
        on-disk cache or from source), CUDA's lazy module loads, cuBLAS handles and workspaces, and the decode
        step's recording, which the next request in the cache replays from its first step where its tiers come
        out as the throwaway's did (the same prompt length and `max_new_tokens`, up to `WARMUP_TOKENS` of prompt:
        the tiers are sized for the request announced, whatever the throwaway's length). `prompt_tokens`
        random tokens (at most `WARMUP_TOKENS`), then `steps` decode steps (default: the eager ones, one
        recorded, one replayed). Returns the seconds it took."""
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if self.cache.get_seq_length():
            raise ValueError(
                "warm_up runs before the runner's requests: its cache holds tokens (TandemCache.reset empties it)"
            )
        start = time.perf_counter()
        steps = self.warmup_steps + 2 if steps is None else steps
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        tokens = min(prompt_tokens, WARMUP_TOKENS)
        limit = self.cache.layers[0].max_positions
        if limit is not None:
            tokens = max(1, min(tokens, limit - steps))
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
        # the tiers sized for the request announced (the host tier is allocated once, for the prompt and answer)
        announced = max(steps, prompt_tokens + max_new_tokens - tokens)
        try:
            logits = self.prefill(ids, max_new_tokens=announced)
            self.decode(logits.argmax(-1), steps)
            self._sync()
        finally:
            self.cache.reset()
            self.next_position = None
        return time.perf_counter() - start

    # ---- one request ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_ids=(),
        chunk_tokens: int = 8192,
        on_token=None,
        append: bool = False,
        prefix_cache: PrefixCache | None = None,
    ) -> torch.Tensor:
        """One prompt's new tokens [n] int64 on the CPU: prefill, then decode steps, each token greedy or drawn by
        `sampler` (one row), up to `max_new_tokens` or a token in `stop_ids`, which is kept (as model.generate
        keeps its end-of-sequence token). input_ids: [1, T]; on_token(token [1] on the CPU) is called as each
        token comes (the caller prints it). append: the prompt continues what the cache holds (`prefill`): the
        last answer's last token, which no step fed, leads the next turn's tokens. prefix_cache: kept prefixes to
        start from and keep to (`prefill`)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, tokens] (one prompt), got {tuple(input_ids.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        stop = set(stop_ids)
        logits = self.prefill(
            input_ids, chunk_tokens=chunk_tokens, max_new_tokens=max_new_tokens, append=append,
            prefix_cache=prefix_cache,
        )  # fmt: skip
        token = (sampler if sampler is not None else _argmax)(logits)
        tokens = [token.cpu()]
        if on_token is not None:
            on_token(tokens[-1])
        if int(tokens[-1][0]) in stop or max_new_tokens == 1:
            return torch.cat(tokens)
        steps = self.stream(token, max_new_tokens - 1, sampler=sampler)
        try:
            for token in steps:
                tokens.append(token.cpu())
                if on_token is not None:
                    on_token(tokens[-1])
                if int(tokens[-1][0]) in stop:
                    break
        finally:
            steps.close()
        return torch.cat(tokens)

    # ---- decode --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, first_tokens: torch.Tensor, steps: int, sampler: Sampler | None = None):
        """Decode: feed `first_tokens` [B] (e.g. the argmax of the prefill logits), then each step's choice: the
        argmax, or `sampler`'s draw (`tandem.engine.sampling.Sampler`: temperature, top-p and seed per row).
        Returns (tokens [B, steps] int64 on the CPU: the tokens produced, seconds per step).
        """
        seconds: list[float] = []
        tokens = list(self.stream(first_tokens, steps, seconds, sampler))
        batch = first_tokens.shape[0]
        history = torch.stack(tokens, dim=1) if tokens else torch.empty(batch, 0, dtype=torch.long)
        return history.cpu(), seconds

    def stream(
        self,
        first_tokens: torch.Tensor,
        steps: int,
        seconds: list | None = None,
        sampler: Sampler | None = None,
    ):
        """`decode` as a generator: yields each step's tokens [B] (int64, on the model's device) once the step
        has run, so a caller can print them as they come or stop early (at an end-of-sequence token: close the
        generator, or just stop iterating). `seconds`, if given, receives each step's wall time. `sampler`: as
        in `decode`; the step's graph records its draw, and its rows move one step per decode step."""
        if self.next_position is None:
            raise ValueError("decode needs a prefilled cache: call prefill() (or fill the cache) first")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        batch = self.next_position.shape[0]
        if tuple(first_tokens.shape) != (batch,):
            raise ValueError(f"first_tokens must be [batch] = [{batch}], got {tuple(first_tokens.shape)}")
        limit = self.cache.layers[0].max_positions
        if limit is not None and self.cache.get_seq_length() + steps > limit:
            raise ValueError(
                f"context of {self.cache.get_seq_length() + steps} tokens exceeds the model's maximum of {limit} "
                "positions (config.max_position_embeddings); decode fewer steps"
            )
        if sampler is not None:
            if not isinstance(sampler, Sampler):
                raise ValueError(
                    f"sampler must be a tandem.engine.Sampler or None, got {type(sampler).__name__}"
                )
            if sampler.step.shape[0] != batch or sampler.step.device != self.device:
                raise ValueError(
                    f"sampler must hold {batch} rows on {self.device}, got {sampler.step.shape[0]} on "
                    f"{sampler.step.device}"
                )
        return self._stream(first_tokens, steps, seconds if seconds is not None else [], sampler)

    def _stream(self, first_tokens: torch.Tensor, steps: int, seconds: list, sampler: Sampler | None = None):
        batch = self.next_position.shape[0]
        step = self._step_for(batch, sampler if sampler is not None else _argmax)
        with torch.inference_mode():
            self._ids.copy_(first_tokens.to(self.device, torch.long).reshape(batch, 1))
            self._positions.copy_(self.next_position.reshape(batch, 1))
        history = torch.empty(batch, steps, dtype=torch.long, device=self.device)
        self.host_seconds = []  # per step: seconds in the CPU parts
        self.cache.step_context = step
        end = torch.cuda.Event(blocking=True) if self.device.type == "cuda" else None
        fused = self.fused_layers or contextlib.nullcontext()
        try:
            for t in range(steps):
                start = time.perf_counter()
                with torch.inference_mode(), fused:
                    self._decode_step(step, t)
                    history[:, t] = self._ids[:, 0]
                    if end is not None:
                        end.record()
                        end.synchronize()  # one event per step, not a device-wide sync
                seconds.append(time.perf_counter() - start)
                self.host_seconds.append(step.host_seconds)
                yield history[:, t]
        finally:
            self.cache.step_context = None
            self.next_position = self._positions[:, 0].clone()
            if any(layer.failed is not None for layer in self.layers):
                self.release()
            elif step.segments and step.layout is None:
                # what the last recording read (every step since replayed it), for the next request's check
                step.layout = read_layout(self.layers, self.device)

    def _step_for(self, batch: int, choose) -> DecodeStep:
        """The step object of a stream of `batch` rows whose tokens `choose` picks: the one kept from the last
        stream where it was made for the same, with its inputs and recording, else a new one. A kept recording
        serves a new request in this cache (after `TandemCache.reset`) only where the request's layers hold
        every tensor the recording reads where it read them (`step.read_layout`); the first step checks."""
        if self._step is not None and self._step_key[0] == batch and self._step_key[1] is choose:
            if self._step.segments and self._step.layout is not None:
                self._step.check_layout = True
            return self._step
        self.release()
        flags = None
        if self.use_graphs and self.handoff == "memops":
            flags = handoff_module.HostFlags(len(self.layers), self.device)
        self._step = DecodeStep(self.device, flags)
        # its launcher thread and recording end with the runner, if not before (`release`)
        self._close_step = weakref.finalize(self, DecodeStep.close, self._step)
        self._step_key = (batch, choose)
        self._choose = choose
        self._ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self._eager_left = self.warmup_steps
        return self._step

    def release(self) -> None:
        """Drop the kept decode step and its recording (the graphs' memory, the launcher thread); the next
        decode makes and records a new one. Also done when the runner is collected."""
        if self._step is not None:
            self._close_step()
        self._step = self._step_key = None

    def _decode_step(self, step: DecodeStep, t: int) -> None:
        try:
            self._run_step(step, t)
        except BaseException as err:
            self.cache.mark_failed(err)  # part of the step may have run: the cache refuses further use
            if isinstance(err, torch.OutOfMemoryError):
                graphs = "recording or running its CUDA graph" if self.use_graphs else "running it"
                raise device_memory_error(
                    err,
                    self.device,
                    f"decode step {t} ({graphs}) at {self.cache.get_seq_length()} tokens",
                    "a smaller batch or window_tokens, gpu_cache=0 (quest), or use_graphs=False",
                ) from err
            raise

    def _run_step(self, step: DecodeStep, t: int) -> None:
        if self.decoder is not None:
            self.decoder.check_weights()
        step.host_seconds = 0.0
        step.prepare(self.layers)
        if step.check_layout:
            # a new request's first step over a kept recording: replayed only if its layers hold what it reads
            # where it read it; else the request starts as a new one would, with eager steps
            step.check_layout = False
            if read_layout(self.layers, self.device) != step.layout:
                step.segments, step.layout = [], None
                self._eager_left = self.warmup_steps
        if self.use_graphs and self._eager_left <= 0:
            generations = [(layer.host.generation, layer.hot.generation) for layer in self.layers]
            if not step.segments or generations != step.generations:
                # (re)record: a host tier that grew has moved the digest mirror the graphs read, a hot tier that
                # grew has moved its storage
                step.capture(self._step_body)
                step.generations = generations
                step.layout = None  # taken when the stream ends (`_stream`)
                self.recordings += 1
            step.replay()
        else:
            self._eager_left -= 1
            self._step_body()

    def _step_body(self) -> None:
        """One decode step at fixed addresses: model forward, the tokens' choice (greedy or the sampler's), inputs
        of the next step."""
        if self.decoder is not None:
            logits = self.decoder(self._ids, self._positions)
            self._ids.copy_(self._choose(logits)[:, None])
            self._positions.add_(1)
            return
        out = self.model(
            input_ids=self._ids,
            position_ids=self._positions,
            use_cache=True,
            logits_to_keep=1,
            **self.cache_kwargs,
        )
        self._ids.copy_(self._choose(out.logits[:, -1])[:, None])
        self._positions.add_(1)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
