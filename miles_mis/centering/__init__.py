"""Score centering: the engine's recorded top-K candidates of every token (`candidates`), read and checked as a host
passes them."""

from .candidates import IDS_KWARG, LOG_PROBS_KWARG, Candidates, read_candidates

__all__ = ["IDS_KWARG", "LOG_PROBS_KWARG", "Candidates", "read_candidates"]
