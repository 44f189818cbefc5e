//! Integration tests of `lockkit`'s session-duration locks over
//! tokio-postgres, on real servers: the default (transaction-held) form,
//! the session-level form and the multiplexed form, on dedicated and pooled
//! connections, behind pgbouncer, over TLS, on a hot standby, and what each
//! does when its connection is lost or its network path goes silent.

mod dedicated;
mod failover;
mod fencing;
mod fencing_load;
mod fencing_refusals;
mod forms;
mod lease;
mod lost;
mod multiplexed;
mod multiplexed_budget;
mod multiplexed_setups;
mod pooler;
mod pooler_hazard;
mod probe;
mod refused;
mod silent;
mod tls;
