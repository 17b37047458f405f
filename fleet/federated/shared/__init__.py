"""What both sides of a round must agree on: the wire's keys, schemas and typed records, the round's record,
the config, how tensors are packed and sent, how devices are named, and the data each one holds. It imports
neither side."""
