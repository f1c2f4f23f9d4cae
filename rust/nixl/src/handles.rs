//! Owned wrappers of the C API's handles: each frees its C++ object in `Drop`.
//!
//! Handles that call into the agent ([`Registration`], [`XferRequest`]) hold an
//! `Rc<AgentCore>`, so the agent is destroyed only after the last of them is gone, whatever
//! order their owner drops them in. `Rc`, not `Arc`: the agent is used from one thread at a
//! time, and every clone lives inside one [`crate::NixlTransport`] (see its `Send` impl).
//!
//! Ownership rules of the C API (read in `wrapper.cpp`), which these wrappers follow:
//! * `get_local_md` returns `malloc` memory and `load_remote_md` a `strdup` name: the caller
//!   frees both;
//! * strings and payloads read out of a notif map, string list or param iterator are borrowed
//!   from it and copied here before it changes;
//! * a backend handle is a small wrapper around a pointer the agent owns: destroying the handle
//!   leaves the backend in place;
//! * `create_xfer_req` copies the descriptor lists and the notification into the request, so
//!   both lists and the opt args may be reused or freed as soon as it returns;
//! * `prep_xfer_dlist` resolves a descriptor list's registrations once (for a peer, against the
//!   metadata loaded for it) into a handle the agent owns until `release_xfer_dlist_handle`,
//!   which also frees the handle's wrapper; the list itself may be freed as soon as it returns.
//!   `make_xfer_req` copies the descriptors the indices name (merging neighbours) and the
//!   notification into the request, so a prepared list may be released while requests made
//!   from it are in flight;
//! * `release_xfer_req` fails (and keeps the request) when the request is still in progress and
//!   the backend cannot cancel it; `destroy_xfer_req` refuses an unreleased request.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::sync::Arc;

use kvpush_core::transport::{MemoryKind, MemorySpace, Notification};

use crate::api::{
    self, AgentS, Api, NotifMapS, OptArgsS, ParamsS, RegDlistS, XferDlistHandleS, XferDlistS,
    XferReqS, MEM_DRAM, MEM_VRAM, XFER_OP_WRITE,
};
use crate::error::{check, NixlError, Status};

/// The C API's memory type for a memory space.
pub(crate) fn mem_type(space: MemorySpace) -> c_int {
    match space.kind {
        MemoryKind::Dram => MEM_DRAM,
        MemoryKind::Vram => MEM_VRAM,
    }
}

/// Copies a C string the C API lends.
///
/// # Safety
///
/// `ptr` is a valid NUL-terminated string for the duration of the call.
unsafe fn lent_string(ptr: *const c_char) -> String {
    // SAFETY: forwarded from the contract.
    unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
}

/// Calls a `create_*(…, *mut H)` function and wraps the non-null result.
fn created<T>(
    op: &'static str,
    detail: impl FnOnce() -> String,
    create: impl FnOnce(*mut *mut T) -> c_int,
) -> Result<NonNull<T>, NixlError> {
    let mut raw = ptr::null_mut();
    let code = create(&mut raw);
    check(op, code, detail)?;
    NonNull::new(raw).ok_or_else(|| {
        NixlError::new(op, Status::Other(code), "the C API reported success but returned null")
    })
}

/// A NIXL agent. Destroyed (`destroy_agent`) when the last handle using it is dropped.
#[derive(Debug)]
pub(crate) struct AgentCore {
    api: Arc<Api>,
    raw: NonNull<AgentS>,
    name: String,
}

impl AgentCore {
    /// Creates an agent called `name` with `config`, and its UCX backend with UCX's default
    /// parameters, each key in `ucx_params` overriding (or adding) one.
    pub(crate) fn create(
        api: &Arc<Api>,
        name: &str,
        config: &api::AgentConfig,
        ucx_params: &[(String, String)],
    ) -> Result<Rc<Self>, NixlError> {
        let c_name = CString::new(name).map_err(|_| {
            NixlError::new("create_configured_agent", Status::InvalidParam, "agent name has a NUL")
        })?;
        let raw = created(
            "create_configured_agent",
            || format!("agent {name:?}"),
            |out| {
                // SAFETY: `c_name` and `config` outlive the call; `out` is a valid out-pointer.
                unsafe { (api.create_configured_agent)(c_name.as_ptr(), config, out) }
            },
        )?;
        let agent = Rc::new(Self { api: Arc::clone(api), raw, name: name.to_owned() });
        agent.create_ucx_backend(ucx_params)?;
        Ok(agent)
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    fn raw(&self) -> *mut AgentS {
        self.raw.as_ptr()
    }

    fn create_ucx_backend(&self, overrides: &[(String, String)]) -> Result<(), NixlError> {
        const UCX: &CStr = c"UCX";
        let api = &self.api;
        let mut mems = ptr::null_mut();
        let mut defaults = ptr::null_mut();
        // SAFETY: the agent is alive; `mems` and `defaults` are valid out-pointers.
        let code =
            unsafe { (api.get_plugin_params)(self.raw(), UCX.as_ptr(), &mut mems, &mut defaults) };
        if let Some(status) = Status::from_code(code) {
            let plugins = self.available_plugins().unwrap_or_default();
            return Err(NixlError::new(
                "get_plugin_params",
                status,
                format!(
                    "agent {:?} found no UCX plugin (plugins found: [{}]); the wheel's plugins \
                     directory sits next to libnixl.so unless NIXL_PLUGIN_DIR says otherwise",
                    self.name,
                    plugins.join(", ")
                ),
            ));
        }
        let _mems = MemList { api, raw: mems };
        let defaults = Params { api, raw: defaults };
        let overridden;
        let params = if overrides.is_empty() {
            &defaults
        } else {
            overridden = Params::merged(api, &defaults.entries()?, overrides)?;
            &overridden
        };
        let mut backend = ptr::null_mut();
        // SAFETY: the agent and `params` are alive; `backend` is a valid out-pointer.
        let code =
            unsafe { (api.create_backend)(self.raw(), UCX.as_ptr(), params.raw, &mut backend) };
        check("create_backend", code, || {
            format!(
                "agent {:?}, UCX with {:?}; on a CPU-only box set UCX_NET_DEVICES=lo and keep tcp \
                 in UCX_TLS",
                self.name,
                params.entries().unwrap_or_default()
            )
        })?;
        if !backend.is_null() {
            // SAFETY: `backend` came from `create_backend`; destroying the handle frees only the
            // C wrapper, the backend itself stays with the agent.
            unsafe { (api.destroy_backend)(backend) };
        }
        Ok(())
    }

    /// The plugin names this agent's NIXL found (for error messages).
    fn available_plugins(&self) -> Result<Vec<String>, NixlError> {
        let api = &self.api;
        let list = created(
            "get_available_plugins",
            || format!("agent {:?}", self.name),
            |out| {
                // SAFETY: the agent is alive; `out` is a valid out-pointer.
                unsafe { (api.get_available_plugins)(self.raw(), out) }
            },
        )?;
        let list = StringList { api, raw: list };
        list.strings()
    }

    /// Registers one region with NIXL; the registration lasts until the returned value drops.
    ///
    /// # Safety
    ///
    /// The region stays valid, and is not freed, until the registration is dropped.
    pub(crate) unsafe fn register(
        self: &Rc<Self>,
        addr: u64,
        len: u64,
        space: MemorySpace,
    ) -> Result<Registration, NixlError> {
        let api = &self.api;
        let what = || format!("{len} bytes at {addr:#x} in {space:?}, agent {:?}", self.name);
        let raw = created("create_reg_dlist", what, |out| {
            // SAFETY: `out` is a valid out-pointer.
            unsafe { (api.create_reg_dlist)(mem_type(space), out) }
        })?;
        let list = RegDescList { api: Arc::clone(api), raw };
        // SAFETY: the list is alive; no per-descriptor metadata (null, 0) is passed.
        let code = unsafe {
            (api.reg_dlist_add_desc)(
                list.raw.as_ptr(),
                addr as usize,
                len as usize,
                u64::from(space.device),
                ptr::null(),
                0,
            )
        };
        check("reg_dlist_add_desc", code, what)?;
        // SAFETY: agent and list are alive; null opt args lets NIXL pick the backends. The
        // memory's validity is the caller's contract.
        let code = unsafe { (api.register_mem)(self.raw(), list.raw.as_ptr(), ptr::null_mut()) };
        check("register_mem", code, what)?;
        Ok(Registration { agent: Rc::clone(self), list })
    }

    /// This agent's metadata blob.
    pub(crate) fn local_metadata(&self) -> Result<Vec<u8>, NixlError> {
        let mut data: *mut c_void = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the agent is alive; `data` and `len` are valid out-pointers.
        let code = unsafe { (self.api.get_local_md)(self.raw(), &mut data, &mut len) };
        check("get_local_md", code, || format!("agent {:?}", self.name))?;
        let blob = if data.is_null() {
            Vec::new()
        } else {
            // SAFETY: on success `data` holds `len` bytes of `malloc` memory that we own.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec()
        };
        // SAFETY: `data` is the caller-owned `malloc` buffer (or null) and is not used again.
        unsafe { api::free_c(data) };
        Ok(blob)
    }

    /// Loads a peer's metadata; returns the peer's agent name.
    pub(crate) fn load_remote_metadata(&self, metadata: &[u8]) -> Result<String, NixlError> {
        if metadata.is_empty() {
            return Err(NixlError::new(
                "load_remote_md",
                Status::InvalidParam,
                format!("agent {:?} was given empty peer metadata", self.name),
            ));
        }
        let mut name: *mut c_char = ptr::null_mut();
        // SAFETY: the agent is alive; `metadata` is valid for its length; `name` is a valid
        // out-pointer.
        let code = unsafe {
            (self.api.load_remote_md)(
                self.raw(),
                metadata.as_ptr().cast(),
                metadata.len(),
                &mut name,
            )
        };
        check("load_remote_md", code, || {
            format!(
                "agent {:?} could not load {} bytes of peer metadata (not a NIXL agent's \
                 get_local_md output, or from an incompatible NIXL)",
                self.name,
                metadata.len()
            )
        })?;
        if name.is_null() {
            return Err(NixlError::new("load_remote_md", Status::Other(0), "no peer name"));
        }
        // SAFETY: on success `name` is a caller-owned `strdup` string.
        let peer = unsafe { lent_string(name) };
        // SAFETY: `name` came from `strdup` and is not used again.
        unsafe { api::free_c(name.cast()) };
        Ok(peer)
    }

    /// Forgets a peer's metadata; its requests fail from now on.
    pub(crate) fn invalidate_remote(&self, peer: &CStr) -> Result<(), NixlError> {
        // SAFETY: the agent and `peer` are alive.
        let code = unsafe { (self.api.invalidate_remote_md)(self.raw(), peer.as_ptr()) };
        check("invalidate_remote_md", code, || format!("peer {peer:?} of agent {:?}", self.name))
    }

    /// Creates a WRITE of `local` into `peer`'s `remote`, carrying the notification in `opts`.
    pub(crate) fn create_write(
        self: &Rc<Self>,
        local: &XferDescList,
        remote: &XferDescList,
        peer: &CStr,
        opts: &OptArgs,
    ) -> Result<XferRequest, NixlError> {
        let api = &self.api;
        let raw = created(
            "create_xfer_req",
            || {
                format!(
                    "WRITE of {} descriptor(s) to peer {peer:?}: the addresses must lie in memory \
                     registered on both sides, and the peer's metadata must be loaded",
                    local.len
                )
            },
            |out| {
                // SAFETY: the agent, both lists, `peer` and `opts` are alive; `out` is a valid
                // out-pointer. The request copies what it needs from the lists and opts.
                unsafe {
                    (api.create_xfer_req)(
                        self.raw(),
                        XFER_OP_WRITE,
                        local.raw.as_ptr(),
                        remote.raw.as_ptr(),
                        peer.as_ptr(),
                        out,
                        opts.raw.as_ptr(),
                    )
                }
            },
        )?;
        Ok(XferRequest { agent: Rc::clone(self), raw, released: false })
    }

    /// Prepares `list` for requests built from indices: against this agent's own registrations
    /// when `peer` is `None`, else against the metadata loaded for `peer`.
    pub(crate) fn prepare(
        self: &Rc<Self>,
        peer: Option<&CStr>,
        list: &XferDescList,
    ) -> Result<PreparedList, NixlError> {
        // NIXL_INIT_AGENT, the name that means "this agent".
        let name = peer.unwrap_or(c"");
        let api = &self.api;
        let raw = created(
            "prep_xfer_dlist",
            || {
                format!(
                    "{} descriptor(s) of {}: each must lie in memory registered by that agent",
                    list.len,
                    peer.map_or_else(
                        || format!("agent {:?}", self.name),
                        |p| format!("peer {p:?}")
                    )
                )
            },
            |out| {
                // SAFETY: the agent, `name` and the list are alive; `out` is a valid out-pointer;
                // null opt args lets NIXL pick the backends.
                unsafe {
                    (api.prep_xfer_dlist)(
                        self.raw(),
                        name.as_ptr(),
                        list.raw.as_ptr(),
                        out,
                        ptr::null_mut(),
                    )
                }
            },
        )?;
        Ok(PreparedList { agent: Rc::clone(self), raw, len: list.len })
    }

    /// Creates a WRITE of `local`'s descriptors at `local_indices` into `remote`'s at
    /// `remote_indices` (pairwise, as many of each), carrying the notification in `opts`. NIXL
    /// merges neighbours that are contiguous on both sides.
    pub(crate) fn make_write(
        self: &Rc<Self>,
        local: &PreparedList,
        local_indices: &[u32],
        remote: &PreparedList,
        remote_indices: &[u32],
        opts: &OptArgs,
    ) -> Result<XferRequest, NixlError> {
        let api = &self.api;
        let raw = created(
            "make_xfer_req",
            || {
                format!(
                    "WRITE of {} block(s) from prepared lists of {} and {} descriptor(s): indices \
                     must be in range, pairwise of equal lengths, and the peer still loaded",
                    local_indices.len(),
                    local.len,
                    remote.len
                )
            },
            |out| {
                // SAFETY: the agent, both prepared lists, both index slices and `opts` are alive;
                // `out` is a valid out-pointer. `u32` and `c_int` have the same size and
                // alignment, so each slice is read as `len` C ints; an index above `i32::MAX`
                // reads as negative, which NIXL, converting it to `size_t`, refuses as out of
                // range, as it refuses every index past its list (checked before any is used).
                unsafe {
                    (api.make_xfer_req)(
                        self.raw(),
                        XFER_OP_WRITE,
                        local.raw.as_ptr(),
                        local_indices.as_ptr().cast::<c_int>(),
                        local_indices.len(),
                        remote.raw.as_ptr(),
                        remote_indices.as_ptr().cast::<c_int>(),
                        remote_indices.len(),
                        out,
                        opts.raw.as_ptr(),
                    )
                }
            },
        )?;
        Ok(XferRequest { agent: Rc::clone(self), raw, released: false })
    }

    /// Sends a notification to `peer`.
    pub(crate) fn send_notification(&self, peer: &CStr, payload: &[u8]) -> Result<(), NixlError> {
        // SAFETY: the agent, `peer` and `payload` are alive for the call; null opt args uses
        // every notification-capable backend.
        let code = unsafe {
            (self.api.gen_notif)(
                self.raw(),
                peer.as_ptr(),
                payload.as_ptr().cast(),
                payload.len(),
                ptr::null_mut(),
            )
        };
        check("gen_notif", code, || format!("{} bytes to peer {peer:?}", payload.len()))
    }

    /// Moves every notification received since the last call into `out`, via `map`. Drives
    /// the agent's progress.
    pub(crate) fn take_notifications(
        &self,
        map: &mut NotifMap,
        out: &mut Vec<Notification>,
    ) -> Result<(), NixlError> {
        // SAFETY: the agent and map are alive; null opt args polls every backend.
        let code = unsafe { (self.api.get_notifs)(self.raw(), map.raw.as_ptr(), ptr::null_mut()) };
        // NIXL fills the map best-effort even when one backend errs: keep what arrived.
        let drained = map.drain_into(out);
        check("get_notifs", code, || format!("agent {:?}", self.name))?;
        drained
    }
}

impl Drop for AgentCore {
    fn drop(&mut self) {
        // SAFETY: every handle that used this agent held an `Rc` to it, so none is left; the
        // agent came from `create_configured_agent` and is destroyed once. Its status cannot be
        // acted on in `drop`.
        let _ = unsafe { (self.api.destroy_agent)(self.raw()) };
    }
}

/// A plugin's parameters (`nixl_b_params_t`).
struct Params<'a> {
    api: &'a Api,
    raw: *mut ParamsS,
}

impl Params<'_> {
    /// A fresh parameter set: `defaults`, then `overrides` replacing or adding keys.
    fn merged<'a>(
        api: &'a Api,
        defaults: &[(String, String)],
        overrides: &[(String, String)],
    ) -> Result<Params<'a>, NixlError> {
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer.
        check("create_params", unsafe { (api.create_params)(&mut raw) }, String::new)?;
        let params = Params { api, raw };
        let kept = defaults.iter().filter(|(k, _)| overrides.iter().all(|(o, _)| o != k));
        for (key, value) in kept.chain(overrides) {
            let bad =
                || NixlError::new("params_add", Status::InvalidParam, format!("NUL in {key:?}"));
            let c_key = CString::new(key.as_str()).map_err(|_| bad())?;
            let c_value = CString::new(value.as_str()).map_err(|_| bad())?;
            // SAFETY: the params and both strings are alive; NIXL copies them.
            let code = unsafe { (api.params_add)(raw, c_key.as_ptr(), c_value.as_ptr()) };
            check("params_add", code, || format!("{key}={value}"))?;
        }
        Ok(params)
    }

    /// Every key and value.
    fn entries(&self) -> Result<Vec<(String, String)>, NixlError> {
        let api = self.api;
        let mut iter = ptr::null_mut();
        // SAFETY: the params are alive; `iter` is a valid out-pointer.
        let code = unsafe { (api.params_create_iterator)(self.raw, &mut iter) };
        check("params_create_iterator", code, String::new)?;
        let mut entries = Vec::new();
        let mut result = Ok(());
        // An exhausted iterator (or empty params) reports `more == false` and sets no strings.
        while !iter.is_null() {
            let (mut key, mut value, mut more) = (ptr::null(), ptr::null(), false);
            // SAFETY: the iterator is alive; the out-pointers are valid.
            let code = unsafe { (api.params_iterator_next)(iter, &mut key, &mut value, &mut more) };
            if let Err(e) = check("params_iterator_next", code, String::new) {
                result = Err(e);
                break;
            }
            if key.is_null() || value.is_null() {
                break;
            }
            // SAFETY: both strings are kept alive by the iterator until its next step.
            entries.push(unsafe { (lent_string(key), lent_string(value)) });
            if !more {
                break;
            }
        }
        if !iter.is_null() {
            // SAFETY: the iterator came from `params_create_iterator` and is destroyed once.
            unsafe { (api.params_destroy_iterator)(iter) };
        }
        result.map(|()| entries)
    }
}

impl Drop for Params<'_> {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: the params came from the C API and are destroyed once.
            unsafe { (self.api.destroy_params)(self.raw) };
        }
    }
}

/// A plugin's supported memory types (unused beyond freeing).
struct MemList<'a> {
    api: &'a Api,
    raw: api::MemListH,
}

impl Drop for MemList<'_> {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: the list came from `get_plugin_params` and is destroyed once.
            unsafe { (self.api.destroy_mem_list)(self.raw) };
        }
    }
}

/// A list of strings the C API returned.
struct StringList<'a> {
    api: &'a Api,
    raw: NonNull<api::StringListS>,
}

impl StringList<'_> {
    fn strings(&self) -> Result<Vec<String>, NixlError> {
        let mut n = 0usize;
        // SAFETY: the list is alive; `n` is a valid out-pointer.
        let code = unsafe { (self.api.string_list_size)(self.raw.as_ptr(), &mut n) };
        check("string_list_size", code, String::new)?;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let mut s = ptr::null();
            // SAFETY: the list is alive and `i` is in range; `s` is a valid out-pointer.
            let code = unsafe { (self.api.string_list_get)(self.raw.as_ptr(), i, &mut s) };
            check("string_list_get", code, String::new)?;
            if !s.is_null() {
                // SAFETY: the string is owned by the list, which is alive.
                out.push(unsafe { lent_string(s) });
            }
        }
        Ok(out)
    }
}

impl Drop for StringList<'_> {
    fn drop(&mut self) {
        // SAFETY: the list came from the C API and is destroyed once.
        unsafe { (self.api.destroy_string_list)(self.raw.as_ptr()) };
    }
}

/// A registration descriptor list.
#[derive(Debug)]
struct RegDescList {
    api: Arc<Api>,
    raw: NonNull<RegDlistS>,
}

impl Drop for RegDescList {
    fn drop(&mut self) {
        // SAFETY: the list came from `create_reg_dlist` and is destroyed once.
        unsafe { (self.api.destroy_reg_dlist)(self.raw.as_ptr()) };
    }
}

/// One registered region; deregistered when dropped.
#[derive(Debug)]
pub(crate) struct Registration {
    agent: Rc<AgentCore>,
    list: RegDescList,
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: agent and list are alive (held by `self`), and this list was registered with
        // this agent. A failed deregistration cannot be acted on in `drop`; destroying the agent
        // releases it anyway.
        let _ = unsafe {
            (self.agent.api.deregister_mem)(
                self.agent.raw(),
                self.list.raw.as_ptr(),
                ptr::null_mut(),
            )
        };
    }
}

/// A transfer descriptor list of one memory type, reused across writes.
#[derive(Debug)]
pub(crate) struct XferDescList {
    api: Arc<Api>,
    raw: NonNull<XferDlistS>,
    mem_type: c_int,
    len: usize,
}

impl XferDescList {
    pub(crate) fn new(api: &Arc<Api>, space: MemorySpace) -> Result<Self, NixlError> {
        let mem_type = mem_type(space);
        let raw = created(
            "create_xfer_dlist",
            || format!("{space:?}"),
            |out| {
                // SAFETY: `out` is a valid out-pointer.
                unsafe { (api.create_xfer_dlist)(mem_type, out) }
            },
        )?;
        Ok(Self { api: Arc::clone(api), raw, mem_type, len: 0 })
    }

    /// Whether this list holds descriptors of `space`'s memory type.
    pub(crate) fn is_for(&self, space: MemorySpace) -> bool {
        self.mem_type == mem_type(space)
    }

    pub(crate) fn clear(&mut self) -> Result<(), NixlError> {
        // SAFETY: the list is alive.
        let code = unsafe { (self.api.xfer_dlist_clear)(self.raw.as_ptr()) };
        check("xfer_dlist_clear", code, String::new)?;
        self.len = 0;
        Ok(())
    }

    pub(crate) fn push(&mut self, addr: u64, len: u64, device: u32) -> Result<(), NixlError> {
        // SAFETY: the list is alive; it only records the numbers.
        let code = unsafe {
            (self.api.xfer_dlist_add_desc)(
                self.raw.as_ptr(),
                addr as usize,
                len as usize,
                u64::from(device),
            )
        };
        check("xfer_dlist_add_desc", code, || format!("{len} bytes at {addr:#x}"))?;
        self.len += 1;
        Ok(())
    }
}

impl Drop for XferDescList {
    fn drop(&mut self) {
        // SAFETY: the list came from `create_xfer_dlist` and is destroyed once.
        unsafe { (self.api.destroy_xfer_dlist)(self.raw.as_ptr()) };
    }
}

/// A descriptor list prepared by one agent (`prep_xfer_dlist`); released when dropped.
#[derive(Debug)]
pub(crate) struct PreparedList {
    agent: Rc<AgentCore>,
    raw: NonNull<XferDlistHandleS>,
    /// Descriptors in the list.
    len: usize,
}

impl Drop for PreparedList {
    fn drop(&mut self) {
        // SAFETY: the agent is alive (held by `self`) and prepared this handle, which is
        // released once; requests made from it keep their own copies. Its status cannot be acted
        // on in `drop`.
        let _ = unsafe {
            (self.agent.api.release_xfer_dlist_handle)(self.agent.raw(), self.raw.as_ptr())
        };
    }
}

/// Optional arguments of a call; here, the notification a WRITE carries.
#[derive(Debug)]
pub(crate) struct OptArgs {
    api: Arc<Api>,
    raw: NonNull<OptArgsS>,
}

impl OptArgs {
    pub(crate) fn new(api: &Arc<Api>) -> Result<Self, NixlError> {
        let raw = created("create_opt_args", String::new, |out| {
            // SAFETY: `out` is a valid out-pointer.
            unsafe { (api.create_opt_args)(out) }
        })?;
        Ok(Self { api: Arc::clone(api), raw })
    }

    /// Makes the next request created with these args carry `payload` as its notification, or
    /// no notification with `None`.
    pub(crate) fn set_notification(&mut self, payload: Option<&[u8]>) -> Result<(), NixlError> {
        let Some(payload) = payload else {
            // SAFETY: the args are alive.
            let code = unsafe { (self.api.opt_args_set_has_notif)(self.raw.as_ptr(), false) };
            return check("opt_args_set_has_notif", code, String::new);
        };
        // SAFETY: the args and `payload` are alive; NIXL copies the bytes. A null pointer is
        // never passed: an empty slice's pointer is dangling but non-null, with length 0.
        let code = unsafe {
            (self.api.opt_args_set_notif_msg)(
                self.raw.as_ptr(),
                payload.as_ptr().cast(),
                payload.len(),
            )
        };
        check("opt_args_set_notif_msg", code, || format!("{} bytes", payload.len()))?;
        // SAFETY: the args are alive.
        let code = unsafe { (self.api.opt_args_set_has_notif)(self.raw.as_ptr(), true) };
        check("opt_args_set_has_notif", code, String::new)
    }
}

impl Drop for OptArgs {
    fn drop(&mut self) {
        // SAFETY: the args came from `create_opt_args` and are destroyed once.
        unsafe { (self.api.destroy_opt_args)(self.raw.as_ptr()) };
    }
}

/// A transfer request. Released and destroyed when dropped, if the backend lets it go.
#[derive(Debug)]
pub(crate) struct XferRequest {
    agent: Rc<AgentCore>,
    raw: NonNull<XferReqS>,
    released: bool,
}

impl XferRequest {
    /// Posts the request. `Ok(true)`: complete already; `Ok(false)`: in progress.
    pub(crate) fn post(&mut self) -> Result<bool, NixlError> {
        #[cfg(test)]
        if faults::take(&faults::FAILED_POSTS) {
            return Err(NixlError::new("post_xfer_req", Status::Backend, "injected"));
        }
        // SAFETY: agent and request are alive; null opt args keeps the notification given at
        // creation (non-null args without a notification would drop it).
        let code = unsafe {
            (self.agent.api.post_xfer_req)(self.agent.raw(), self.raw.as_ptr(), ptr::null_mut())
        };
        self.outcome("post_xfer_req", code)
    }

    /// Polls the request (and sends its notification once the data is complete).
    /// `Ok(true)`: complete; `Ok(false)`: in progress.
    pub(crate) fn poll(&mut self) -> Result<bool, NixlError> {
        #[cfg(test)]
        if faults::take(&faults::FAILED_POLLS) {
            return Err(NixlError::new("get_xfer_status", Status::Backend, "injected"));
        }
        // SAFETY: agent and request are alive.
        let code = unsafe { (self.agent.api.get_xfer_status)(self.agent.raw(), self.raw.as_ptr()) };
        self.outcome("get_xfer_status", code)
    }

    fn outcome(&self, op: &'static str, code: c_int) -> Result<bool, NixlError> {
        match Status::from_code(code) {
            None => Ok(true),
            Some(Status::InProgress) => Ok(false),
            Some(status) => Err(NixlError::new(op, status, String::new())),
        }
    }

    /// Releases the request, cancelling it if it is still in progress. When the backend cannot
    /// let it go yet, hands it back with the error, to be tried again later.
    pub(crate) fn release(mut self) -> Result<(), (Self, NixlError)> {
        match self.try_release() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    fn try_release(&mut self) -> Result<(), NixlError> {
        if self.released {
            return Ok(());
        }
        #[cfg(test)]
        if faults::take(&faults::REFUSED_RELEASES) {
            return Err(NixlError::new("release_xfer_req", Status::Backend, "injected"));
        }
        // SAFETY: agent and request are alive and the request is not yet released.
        let code =
            unsafe { (self.agent.api.release_xfer_req)(self.agent.raw(), self.raw.as_ptr()) };
        check("release_xfer_req", code, || {
            "the backend could not cancel an in-progress WRITE; will retry".to_owned()
        })?;
        self.released = true;
        Ok(())
    }
}

impl Drop for XferRequest {
    fn drop(&mut self) {
        if self.try_release().is_ok() {
            // SAFETY: the request was released (its C++ request freed); this frees the C
            // wrapper, once.
            unsafe { (self.agent.api.destroy_xfer_req)(self.raw.as_ptr()) };
        }
        // Otherwise the backend still owns the in-flight request: leaking its small wrapper is
        // the only sound choice, since freeing it could free memory the backend still uses.
    }
}

/// A notification map, reused across `get_notifs` calls.
#[derive(Debug)]
pub(crate) struct NotifMap {
    api: Arc<Api>,
    raw: NonNull<NotifMapS>,
}

impl NotifMap {
    pub(crate) fn new(api: &Arc<Api>) -> Result<Self, NixlError> {
        let raw = created("create_notif_map", String::new, |out| {
            // SAFETY: `out` is a valid out-pointer.
            unsafe { (api.create_notif_map)(out) }
        })?;
        Ok(Self { api: Arc::clone(api), raw })
    }

    /// Appends every notification in the map to `out` and clears the map.
    ///
    /// Cost: O(agents² + notifications): the C API finds the i-th agent by walking its
    /// `unordered_map`, and a process has few peers.
    fn drain_into(&mut self, out: &mut Vec<Notification>) -> Result<(), NixlError> {
        let api = &self.api;
        let map = self.raw.as_ptr();
        let mut agents = 0usize;
        // SAFETY: the map is alive; `agents` is a valid out-pointer.
        check("notif_map_size", unsafe { (api.notif_map_size)(map, &mut agents) }, String::new)?;
        let mut result = Ok(());
        'agents: for i in 0..agents {
            let mut name = ptr::null();
            // SAFETY: the map is alive and not modified while its strings are in use; `i` is
            // below its size.
            let code = unsafe { (api.notif_map_get_agent_at)(map, i, &mut name) };
            if let Err(e) = check("notif_map_get_agent_at", code, || format!("index {i}")) {
                result = Err(e);
                break;
            }
            if name.is_null() {
                continue;
            }
            // SAFETY: `name` is the map's key string, alive until the map changes.
            let from = unsafe { lent_string(name) };
            let mut count = 0usize;
            // SAFETY: as above; `count` is a valid out-pointer.
            let code = unsafe { (api.notif_map_get_notifs_size)(map, name, &mut count) };
            if let Err(e) = check("notif_map_get_notifs_size", code, || from.clone()) {
                result = Err(e);
                break;
            }
            for j in 0..count {
                let (mut data, mut len) = (ptr::null(), 0usize);
                // SAFETY: as above; `j` is below the agent's count.
                let code = unsafe { (api.notif_map_get_notif)(map, name, j, &mut data, &mut len) };
                if let Err(e) = check("notif_map_get_notif", code, || format!("{from} #{j}")) {
                    result = Err(e);
                    break 'agents;
                }
                let payload = if len == 0 || data.is_null() {
                    Vec::new()
                } else {
                    // SAFETY: `data` holds `len` bytes owned by the map, alive until it changes.
                    unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec()
                };
                out.push(Notification { from: from.clone(), payload });
            }
        }
        // SAFETY: the map is alive; no borrowed string or payload outlives this point.
        let cleared = check("notif_map_clear", unsafe { (api.notif_map_clear)(map) }, String::new);
        result.and(cleared)
    }
}

impl Drop for NotifMap {
    fn drop(&mut self) {
        // SAFETY: the map came from `create_notif_map` and is destroyed once.
        unsafe { (self.api.destroy_notif_map)(self.raw.as_ptr()) };
    }
}

/// Failures a test injects into this thread's next calls (NIXL gives no way to make a real
/// request fail, or its release be refused, on demand).
#[cfg(test)]
pub(crate) mod faults {
    use std::cell::Cell;
    use std::thread::LocalKey;

    thread_local! {
        /// Posts that fail (without posting).
        pub(crate) static FAILED_POSTS: Cell<u32> = const { Cell::new(0) };
        /// Polls that fail (without polling).
        pub(crate) static FAILED_POLLS: Cell<u32> = const { Cell::new(0) };
        /// Releases the backend refuses, as it does a request it cannot cancel.
        pub(crate) static REFUSED_RELEASES: Cell<u32> = const { Cell::new(0) };
    }

    /// Injects `count` more of `fault`.
    pub(crate) fn inject(fault: &'static LocalKey<Cell<u32>>, count: u32) {
        fault.with(|left| left.set(left.get() + count));
    }

    /// Whether this call fails (one fewer left).
    pub(super) fn take(fault: &'static LocalKey<Cell<u32>>) -> bool {
        fault.with(|left| {
            let failing = left.get() > 0;
            left.set(left.get().saturating_sub(1));
            failing
        })
    }
}
