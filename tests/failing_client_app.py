"""A ClientApp for tests only: the real device, except that device 1 raises in round 1.

Fault injection stays out of the production config and ClientApp: a test that needs a
device failing mid-round launches the simulation with this app instead.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from client import client_app
from fleet.federated.shared import keys

FAIL_PARTITION = 1
FAIL_ROUND = 1

app = ClientApp()
app.query()(client_app.query)
app.evaluate()(client_app.evaluate)


class InjectedFailure(RuntimeError):
    """Raised on purpose to test a device failing mid-round."""


@app.train()
def train(msg: Message, context: Context) -> Message:
    server_round = int(msg.content[keys.CONFIG][keys.SERVER_ROUND])
    if int(context.node_config["partition-id"]) == FAIL_PARTITION and server_round == FAIL_ROUND:
        raise InjectedFailure(f"device {FAIL_PARTITION} failed on purpose in round {server_round}")
    return client_app.train(msg, context)
