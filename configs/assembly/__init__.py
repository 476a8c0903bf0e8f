"""The one builder: every command turns settings into parts here.

- parts.py: process group and threads, tokenizer/renderer, models, the policy, the trainer;
- demos.py: the SFT warm start's demonstrations and its trainer settings;
- placement.py: where async mode's generator runs, and its cores;
- loop.py: the RL loop's runner, batch source, evaluator and schedule; the generators' main.
"""
