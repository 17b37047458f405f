"""What starts a run: preparing its start (profile, pretrained model), new devices' personalization, and the
generated config reference. It may import either side."""
