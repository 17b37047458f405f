"""A ClientApp for tests only: the real device, which also notes the Ray node it ran on.

The Ray-cluster test needs to see that ClientApps ran on both of its nodes; the
production ClientApp has no reason to know about Ray. Each train message appends this
actor's Ray node id to ``<output_dir>/ray-nodes.txt``.
"""

from __future__ import annotations

import ray
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from client import client_app
from fleet.federated.shared.config import config_from_run_config, run_dir

NODES_FILE = "ray-nodes.txt"

app = ClientApp()
app.query()(client_app.query)
app.evaluate()(client_app.evaluate)


@app.train()
def train(msg: Message, context: Context) -> Message:
    out = run_dir(config_from_run_config(dict(context.run_config))).parent / NODES_FILE
    with out.open("a") as f:
        f.write(ray.get_runtime_context().get_node_id() + "\n")
    return client_app.train(msg, context)
