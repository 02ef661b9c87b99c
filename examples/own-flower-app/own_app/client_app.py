"""The example's ClientApp: your own training code; two fedfuse lines make the reply a fedfuse strategy accepts.

``read_train_message`` gives the global weights (whatever the strategy's ``arrayrecord_key``) and what the
strategy asks for; ``reply_to_train`` sends the weights back under the same record name, the sample count
under ``weight_key`` (the strategy's ``weighted_by_key``), neuron-importance scores on the validation data only if
the train config says ``need-importance``, the class counts only if it says ``need-class-counts``, and the statistics
of a method that reads them (RegMean, Fisher merging) on the training data only if it says ``need-statistics``.

The scores are conductance, not the default DeepLIFT: captum's DeepLIFT hooks each module once per forward, and
Flower's ``Net`` applies its one ``self.pool`` twice.
"""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedfuse.flower import read_train_message, reply_to_train
from own_app.task import Net, client_data, train

app = ClientApp()


@app.train()
def train_handler(msg: Message, context: Context) -> Message:
    request = read_train_message(msg)                                   # fedfuse line 1
    model = Net()
    model.load_state_dict(request.state_dict())
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x, y, x_val, y_val = client_data(pid, n)
    loss = train(model, x, y, epochs=int(context.run_config["local-epochs"]), lr=float(context.run_config["lr"]))
    return reply_to_train(msg, model, num_examples=len(x), val_data=(x_val, y_val), train_data=(x, y),   # fedfuse line 2
                          class_counts=y.bincount(minlength=10).tolist(), train_metrics={"train-loss": loss},
                          partition_id=pid, weight_key="num-train", importance="conductance")
