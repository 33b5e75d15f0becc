"""Score centering: the engine's recorded top-K candidates of every token (`candidates`, read and checked as a host
passes them) and the score-centered loss of every token from the trainer's and the engine's log-probs of the sampled
token and the candidates (`estimator`)."""

from .candidates import IDS_KWARG, LOG_PROBS_KWARG, Candidates, read_candidates
from .estimator import CenteredLoss, Weighting, centered_loss

__all__ = ["IDS_KWARG", "LOG_PROBS_KWARG", "Candidates", "CenteredLoss", "Weighting", "centered_loss",
           "read_candidates"]
