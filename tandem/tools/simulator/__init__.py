"""System model of GPU + CXL processing-near-memory decoding (the PNM-KV paper): ``tandem simulate``.

Example:
    >>> from tandem.simulator import SystemConfig, simulate
    >>> r = simulate(SystemConfig.build("llama-3.1-70b", "128k", gpus=2, pnm=8, scheme="pnkv"))
    >>> r.step.batch
    96
"""

from tandem.tools.simulator.config import SCHEMES, SystemConfig, Workload, parse_context
from tandem.tools.simulator.model import SimResult, format_result, simulate

__all__ = ["SCHEMES", "SimResult", "SystemConfig", "Workload", "format_result", "parse_context", "simulate"]
