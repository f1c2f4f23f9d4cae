//! Which agent a peer's agent name stands for in this worker: its identity is the name *and* its
//! metadata (a digest of it), never the self-declared name alone.
//!
//! The transport knows peers by agent name, and a name is loaded once however many connections
//! use it (a reconnect of the same process shares it). A second process that declares the same
//! name with other metadata is another agent: if it were let through, its registrations would
//! resolve to the first one's agent and be written into the first process's memory. So each
//! name is bound to one metadata digest for as long as anything here uses it:
//!
//! - every joined connection *claims* its peer's (name, digest) at the handshake, and a claim
//!   of a name bound to another digest is refused there (the peer hears `incompatible`, naming
//!   the collision);
//! - the writer marks the name *loaded* while the transport holds it (a connection or a write
//!   in flight uses it), and checks the digest again before it shares a loaded agent.
//!
//! A name is free again once no connection claims it and the transport has forgotten it.

use std::collections::HashMap;
use std::sync::Mutex;

use sha2::{Digest as _, Sha256};

use crate::sync::lock;
use crate::transport::TransportError;

/// SHA-256 of a peer's agent metadata.
pub(crate) type Digest = [u8; 32];

/// The digest of `metadata`.
pub(crate) fn digest(metadata: &[u8]) -> Digest {
    Sha256::digest(metadata).into()
}

/// One name's binding.
#[derive(Debug)]
struct Binding {
    digest: Digest,
    /// Joined connections whose peer declared this name.
    connections: usize,
    /// Whether the transport holds the name now.
    loaded: bool,
}

/// The names bound in this worker; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct Agents {
    bindings: Mutex<HashMap<String, Binding>>,
}

impl Agents {
    /// A connection whose peer declared agent `name` with metadata `digest` joins. `Err` when
    /// `name` stands for another agent here; the connection must then be refused.
    pub(crate) fn claim(
        &self,
        engine_id: &str,
        name: &str,
        digest: Digest,
    ) -> Result<(), AgentCollision> {
        let mut bindings = lock(&self.bindings);
        match bindings.get_mut(name) {
            Some(bound) if bound.digest != digest => Err(collision(engine_id, name)),
            Some(bound) => {
                bound.connections += 1;
                Ok(())
            }
            None => {
                bindings.insert(name.to_owned(), Binding { digest, connections: 1, loaded: false });
                Ok(())
            }
        }
    }

    /// A connection that claimed `name` is gone.
    pub(crate) fn release(&self, name: &str) {
        let mut bindings = lock(&self.bindings);
        if let Some(bound) = bindings.get_mut(name) {
            bound.connections = bound.connections.saturating_sub(1);
            if bound.connections == 0 && !bound.loaded {
                bindings.remove(name);
            }
        }
    }

    /// Whether the transport may use (load, or share) agent `name` for a peer whose metadata
    /// has `digest`: `Err` when the name is bound to another agent. Marks it loaded.
    pub(crate) fn load(
        &self,
        engine_id: &str,
        name: &str,
        digest: Digest,
    ) -> Result<(), AgentCollision> {
        let mut bindings = lock(&self.bindings);
        let bound = bindings.entry(name.to_owned()).or_insert(Binding {
            digest,
            connections: 0,
            loaded: false,
        });
        if bound.digest != digest {
            return Err(collision(engine_id, name));
        }
        bound.loaded = true;
        Ok(())
    }

    /// The transport forgot agent `name`.
    pub(crate) fn unload(&self, name: &str) {
        let mut bindings = lock(&self.bindings);
        if let Some(bound) = bindings.get_mut(name) {
            bound.loaded = false;
            if bound.connections == 0 {
                bindings.remove(name);
            }
        }
    }
}

/// A peer declares an agent name bound here to other metadata: two processes use one name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "peer {engine_id} declares NIXL agent {name:?}, but that name already stands for another \
     agent here (different agent metadata): two processes use one agent name. Give every \
     worker a unique agent name (the default is unique per process), then restart the one \
     that reused it"
)]
pub(crate) struct AgentCollision {
    /// The peer's engine.
    pub(crate) engine_id: String,
    /// The agent name it declared.
    pub(crate) name: String,
}

/// Why P cannot use a peer's transport agent, so cannot write into the peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UnusableAgent {
    /// The peer's Hello carried no agent metadata.
    #[error("peer {engine_id} sent no agent metadata: it cannot be written to")]
    NoMetadata { engine_id: String },
    /// The name stands for another agent here.
    #[error(transparent)]
    Collision(#[from] AgentCollision),
    /// The transport could not load the metadata.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The metadata loaded as another agent than the Hello declared.
    #[error(
        "peer {engine_id}'s agent metadata names agent {loaded:?} but its hello says {declared:?}"
    )]
    Misnamed { engine_id: String, loaded: String, declared: String },
}

fn collision(engine_id: &str, name: &str) -> AgentCollision {
    AgentCollision { engine_id: engine_id.to_owned(), name: name.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_bound_to_one_agent_while_anything_uses_it() {
        let agents = Agents::default();
        let (first, second) = (digest(b"agent a, process 1"), digest(b"agent a, process 2"));
        agents.claim("d-0", "a", first).unwrap();
        // The same process again (a reconnect) shares the name; another process does not.
        agents.claim("d-0", "a", first).unwrap();
        let refused = agents.claim("d-1", "a", second).unwrap_err();
        assert_eq!(refused, collision("d-1", "a"));
        let text = refused.to_string();
        assert!(text.contains("\"a\"") && text.contains("d-1"), "{text}");
        agents.load("d-0", "a", first).unwrap();
        assert!(agents.load("d-1", "a", second).is_err(), "the writer's check agrees");
        // Both connections gone, but a write still holds the agent: still bound.
        agents.release("a");
        agents.release("a");
        assert!(agents.claim("d-1", "a", second).is_err());
        // The transport forgot it: the name is free for another agent.
        agents.unload("a");
        agents.claim("d-1", "a", second).unwrap();
    }

    #[test]
    fn an_unloaded_name_stays_bound_while_a_connection_claims_it() {
        let agents = Agents::default();
        let mine = digest(b"mine");
        agents.claim("d-0", "a", mine).unwrap();
        agents.load("d-0", "a", mine).unwrap();
        agents.unload("a");
        assert!(agents.claim("d-1", "a", digest(b"theirs")).is_err());
        agents.release("a");
        agents.claim("d-1", "a", digest(b"theirs")).unwrap();
    }
}
