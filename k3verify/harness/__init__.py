"""The harness: registry, cases, runner, overflow maps, reports. Reaches modules only through the registry."""
