"""Score centering: the engine's recorded top-K candidates of every token (`candidates`, read and checked as a host
passes them) and the score-centered loss of every token from the trainer's and the engine's log-probs of the sampled
token and the candidates (`estimator`); the trainer's log-probs of those ids from vocabulary-parallel logits, without a
vocabulary gather (`vocab_log_probs`)."""

from .candidates import IDS_KWARG, LOG_PROBS_KWARG, Candidates, read_candidates
from .estimator import CenteredLoss, Weighting, centered_loss, centered_loss_from_logits
from .vocab_log_probs import VocabShard, selected_log_probs, support_log_probs

__all__ = ["IDS_KWARG", "LOG_PROBS_KWARG", "Candidates", "CenteredLoss", "VocabShard", "Weighting", "centered_loss",
           "centered_loss_from_logits", "read_candidates", "selected_log_probs", "support_log_probs"]
