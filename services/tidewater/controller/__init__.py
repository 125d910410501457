"""The controller: etcd-lease election, LeaderAndIsr decisions, broker liveness, admin
operations."""
