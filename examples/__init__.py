"""Example agent programs, outside the library's core: `toolgym.examples.shop_agent` is the one
README's "Train your own agent" trains (configs/shop_agent.toml)."""
