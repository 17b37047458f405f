"""The server's side of a round: the one loop, its bounded waits, the coordinator's decisions, the defense,
the membership, the state it checkpoints and the record it writes. It imports the shared side only, never the
device's."""
