//! The extender's Kubernetes I/O, in one room: the watches that keep the domain's view
//! current ([`watch`], over the trimmed pods of [`watched_pod`]), the writes behind the
//! domain's ports ([`writes`]: Bindings, Events) and the idle-GPU taint's node patches
//! ([`idle_gpu_taint`]). The Lease is the leadership room's own ([`crate::leader`]).
//!
//! Why one room: everything that talks to the API server is here, each piece calling the
//! domain ([`crate::scheduling`]) or implementing one of its ports, and the domain never
//! imports this module, so it runs and is tested without a cluster.

pub mod idle_gpu_taint;
pub mod watch;
pub mod watched_pod;
pub mod writes;
