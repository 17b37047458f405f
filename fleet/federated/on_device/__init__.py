"""The device's side of a round: what a device does with each message (tasks), its local round, its
personalization methods, who it is and the state it keeps. It imports the shared side only, never the
server's."""
