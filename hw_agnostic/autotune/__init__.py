"""Device naming, the config-key policy, tuned-config files and the tuner."""
