"""The evaluation harness behind `rotkv eval`: nll, attn-error and niah tasks, peers, report and plots."""
