"""Asynchronous RL (`loop.mode = "async"`): a generator samples groups while the trainer trains.

- `producer.py`: `GroupProducer`, the background roll-out of scored groups into a bounded buffer,
  with what a checkpoint needs to resume without losing or repeating a group.
- `batch.py`: `take_batch`, one training batch from the buffer, with the staleness bound applied
  (over-stale groups dropped or down-weighted, counted).
- `placement.py`: which configs can run async here, and the cores of the generator processes
  and the trainer.
- `ranks.py`: the same across torchrun's ranks: generator ranks send their groups to trainer
  rank 0, which sends them the weights (`loop.generator_ranks`).
"""
