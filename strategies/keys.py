"""Record names and keys of the messages the strategies send and read.

Flower's conventions where Flower has one ("arrays", "config", "num-examples"). They are
defined here, in the lowest layer, because the strategies need them; app/protocol.py
re-exports them with the rest of the wire format for the ClientApp.
"""

ARRAYS = "arrays"  # ArrayRecord: the model sent, or the one trained
# ArrayRecord: the parameters kept frozen (model.trainable), sent with every task and never aggregated
FROZEN = "frozen-arrays"
SCAFFOLD_C = "scaffold-c"  # ArrayRecord of a SCAFFOLD task: the server's control variate c
SCAFFOLD_DELTA = "scaffold.dc."  # a SCAFFOLD reply's arrays: this prefix + a key holds the node's change of c_i
CONFIG = "config"  # ConfigRecord of a task: the client settings, plus SERVER_ROUND and TASK
METRICS = "metrics"  # MetricRecord of a reply
SERVER_ROUND = "server-round"  # the round (FedBuff: the model version) a task trains from
TASK = "task"  # FedBuff: the task's serial number (a fresh shuffle per task)
# node_config of a simulated SuperNode; also in replies: the server binds the node to it and caps its weight
PARTITION_ID = "partition-id"
NUM_EXAMPLES = "num-examples"  # a reply's weight claim (capped by the server: strategies/replies.py)
# A reply's ConfigRecord of what a node says about itself: NAME, the `name` in its node config (a
# deployed SuperNode's site name, also that node_config key). A claim for logs only, always shown
# beside the node id (strategies/node_names.py).
NODE = "node"
NAME = "name"
