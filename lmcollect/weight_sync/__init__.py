"""Weight synchronisation between a trainer and the collectors' inference engines."""
from lmcollect.weight_sync.weights import check_weights, load_weights_, to_weight_dict

__all__ = ["check_weights", "load_weights_", "to_weight_dict"]
