"""Quality regression of a candidate against its reference (no Django):
`evaluate_quality(candidate, reference, Settings(...)) -> QualityReport`, with each
side a model folder scored in-process (`EngineModel`) or an OpenAI-compatible
endpoint (`Endpoint`). CLI: `python -m gpuagent.evaluate --candidate URL|DIR
--reference URL|DIR`."""

from gpuagent.evaluate.inprocess import EngineModel
from gpuagent.evaluate.regression import Settings, evaluate_quality
from gpuagent.evaluate.remote import Endpoint, EndpointError

__all__ = ["Endpoint", "EndpointError", "EngineModel", "Settings", "evaluate_quality"]
