"""The RL loop (rl.py) over a batch source (sources.py): sync collection, a group producer in this
process (producer.py), or generators of their own (generators.py); staleness.py takes async
batches under the staleness bound."""
