"""What both collectors share: config, batching, versions, weights, groups and checkpoint checks."""
