"""Remote islands: island workers over gRPC, driven by the same single controller."""
