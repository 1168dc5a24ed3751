"""What the tests share: recorded answers replayed on loopback (Azure's, a container registry's,
the Kubernetes API's), the Pulumi mocks' harness, elastic clusters of real agents, a Trainer on
a gloo group of one, and what torch raises for a lost peer."""
