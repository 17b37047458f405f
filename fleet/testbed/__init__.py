"""The emulated-device testbed: real SuperLink and SuperNode processes on one Linux machine, each device
in its own cgroup (CPU quota, memory limit) and network namespace (uplink and downlink shaped with tc).

It launches processes and changes kernel state, so it is part of the top layer: nothing in the engine
or the federated core imports it.
"""
