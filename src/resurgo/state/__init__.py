"""State: flatten nested state to {key: leaf} and back; Stateful; TrainState; RNG; data position."""
