//! The NIXL C API as kvpush uses it: the one place its declarations live, and the loader.
//!
//! The pip wheel (`nixl-cu12` / `nixl-cu13`) ships `.nixl_cuXX.mesonpy.libs/libnixl_capi.so`,
//! the C API that NIXL's own Rust bindings wrap (`src/bindings/rust/wrapper.h` in
//! `ai-dynamo/nixl`). It has no headers in the wheel, so the functions used here are declared by
//! hand from `wrapper.h` (NIXL 1.4.0 tree; checked against the 1.5.1 wheel, whose export set is a
//! superset) and resolved with `dlopen`/`dlsym` when [`Library::load`] runs: nothing NIXL-related
//! is needed to build this crate.
//!
//! ABI notes, all checked against the 1.5.1 wheel's machine code:
//! * every C enum (`nixl_capi_status_t`, memory type, op, thread sync) is an `int`, so they are
//!   `c_int` here and unknown values stay representable;
//! * [`AgentConfig`]'s layout is the ABI-fragile part: 40 bytes, fields at 0/1/4/8/12/16/24/32
//!   (asserted below);
//! * `nixl_capi_create_xfer_dlist` and `nixl_capi_create_reg_dlist` take two arguments (older
//!   trees had a third, `sorted`);
//! * the prepared-list calls (`prep_xfer_dlist`, `make_xfer_req`, `release_xfer_dlist_handle`)
//!   are declared as in `wrapper.h` of the 1.4.0 tree and of the tree after 1.5.0 (unchanged
//!   between them); indices are C `int`s, and `release_xfer_dlist_handle` frees the handle's
//!   wrapper too (1.5.1's machine code calls `operator delete` after `releasedDlistH`).
//!
//! The C API has no version call: the NIXL version is the wheel's, read by Python from the
//! `nixl_cuXX` dist-info.

use std::ffi::{c_char, c_int, c_uint, c_void, OsStr};
use std::fmt;
use std::marker::{PhantomData, PhantomPinned};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use libloading::os::unix::{Library as DlLibrary, RTLD_GLOBAL, RTLD_NOW};

use crate::error::LoadError;

#[cfg(not(target_pointer_width = "64"))]
compile_error!("kvpush-nixl passes u64 addresses and lengths as size_t: 64-bit targets only");

/// The environment variable [`Library::discover`] reads: the absolute path of `libnixl_capi.so`.
pub const CAPI_PATH_ENV: &str = "KVPUSH_NIXL_CAPI";

/// `nixl_capi_status_t` values.
pub(crate) mod status {
    use std::ffi::c_int;
    pub const SUCCESS: c_int = 0;
    pub const IN_PROG: c_int = 1;
    pub const INVALID_PARAM: c_int = -1;
    pub const BACKEND: c_int = -2;
    pub const INVALID_STATE: c_int = -3;
    pub const EXCEPTION: c_int = -4;
    pub const NO_TELEMETRY: c_int = -5;
    pub const NOT_FOUND: c_int = -6;
}

/// `nixl_capi_mem_type_t` values used here.
pub(crate) const MEM_DRAM: c_int = 0;
pub(crate) const MEM_VRAM: c_int = 1;
/// `nixl_capi_xfer_op_t::NIXL_CAPI_XFER_OP_WRITE`.
pub(crate) const XFER_OP_WRITE: c_int = 1;
/// `nixl_capi_thread_sync_t::NIXL_CAPI_THREAD_SYNC_NONE`: one thread makes every call.
pub(crate) const THREAD_SYNC_NONE: c_int = 0;

/// `nixl_capi_agent_config_t`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct AgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    pub thread_sync: c_int,
    /// Not read by the 1.5.1 wrapper (the UCX backend's `num_workers` parameter is what counts).
    pub num_workers: c_uint,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<AgentConfig>() == 40);
    assert!(offset_of!(AgentConfig, enable_listen_thread) == 1);
    assert!(offset_of!(AgentConfig, listen_port) == 4);
    assert!(offset_of!(AgentConfig, thread_sync) == 8);
    assert!(offset_of!(AgentConfig, num_workers) == 12);
    assert!(offset_of!(AgentConfig, pthr_delay_us) == 16);
    assert!(offset_of!(AgentConfig, lthr_delay_us) == 24);
    assert!(offset_of!(AgentConfig, capture_telemetry) == 32);
};

macro_rules! opaque {
    ($($name:ident),* $(,)?) => {$(
        /// An opaque C++ object behind a C API handle.
        #[repr(C)]
        pub(crate) struct $name {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    )*};
}

opaque!(
    AgentS,
    ParamsS,
    MemListS,
    StringListS,
    BackendS,
    OptArgsS,
    ParamIterS,
    XferDlistS,
    XferDlistHandleS,
    RegDlistS,
    XferReqS,
    NotifMapS,
);

pub(crate) type AgentH = *mut AgentS;
pub(crate) type ParamsH = *mut ParamsS;
pub(crate) type MemListH = *mut MemListS;
pub(crate) type StringListH = *mut StringListS;
pub(crate) type BackendH = *mut BackendS;
pub(crate) type OptArgsH = *mut OptArgsS;
pub(crate) type ParamIterH = *mut ParamIterS;
pub(crate) type XferDlistH = *mut XferDlistS;
pub(crate) type XferDlistHandleH = *mut XferDlistHandleS;
pub(crate) type RegDlistH = *mut RegDlistS;
pub(crate) type XferReqH = *mut XferReqS;
pub(crate) type NotifMapH = *mut NotifMapS;

/// Declares the function table, the list of its symbol names, and the resolver, from one list.
macro_rules! capi {
    ($( $field:ident : fn($($arg:ty),* $(,)?) -> $ret:ty; )*) => {
        /// The resolved `nixl_capi_*` functions. Field `x` is symbol `nixl_capi_x`.
        pub(crate) struct Api {
            $( pub(crate) $field: unsafe extern "C" fn($($arg),*) -> $ret, )*
        }

        /// Every `nixl_capi_*` symbol kvpush resolves, in declaration order.
        pub const SYMBOLS: &[&str] = &[$( concat!("nixl_capi_", stringify!($field)) ),*];

        impl Api {
            /// Resolves every symbol, or names every one that is missing.
            fn resolve(lib: &DlLibrary) -> Result<Self, Vec<String>> {
                let mut missing = Vec::new();
                $(
                    // SAFETY: the type is the one `wrapper.h` declares for this symbol (see the
                    // module docs), and the library is never unloaded (`Library::load`).
                    let $field = unsafe {
                        lookup::<unsafe extern "C" fn($($arg),*) -> $ret>(
                            lib,
                            concat!("nixl_capi_", stringify!($field), "\0"),
                            &mut missing,
                        )
                    };
                )*
                match ($($field,)*) {
                    ($(Some($field),)*) => Ok(Self { $($field,)* }),
                    _ => Err(missing),
                }
            }
        }
    };
}

capi! {
    is_stub: fn() -> bool;
    create_configured_agent: fn(*const c_char, *const AgentConfig, *mut AgentH) -> c_int;
    destroy_agent: fn(AgentH) -> c_int;
    get_available_plugins: fn(AgentH, *mut StringListH) -> c_int;
    destroy_string_list: fn(StringListH) -> c_int;
    string_list_size: fn(StringListH, *mut usize) -> c_int;
    string_list_get: fn(StringListH, usize, *mut *const c_char) -> c_int;
    get_plugin_params: fn(AgentH, *const c_char, *mut MemListH, *mut ParamsH) -> c_int;
    destroy_mem_list: fn(MemListH) -> c_int;
    destroy_params: fn(ParamsH) -> c_int;
    create_params: fn(*mut ParamsH) -> c_int;
    params_add: fn(ParamsH, *const c_char, *const c_char) -> c_int;
    params_create_iterator: fn(ParamsH, *mut ParamIterH) -> c_int;
    params_iterator_next: fn(ParamIterH, *mut *const c_char, *mut *const c_char, *mut bool) -> c_int;
    params_destroy_iterator: fn(ParamIterH) -> c_int;
    create_backend: fn(AgentH, *const c_char, ParamsH, *mut BackendH) -> c_int;
    destroy_backend: fn(BackendH) -> c_int;
    create_reg_dlist: fn(c_int, *mut RegDlistH) -> c_int;
    reg_dlist_add_desc: fn(RegDlistH, usize, usize, u64, *const c_void, usize) -> c_int;
    destroy_reg_dlist: fn(RegDlistH) -> c_int;
    register_mem: fn(AgentH, RegDlistH, OptArgsH) -> c_int;
    deregister_mem: fn(AgentH, RegDlistH, OptArgsH) -> c_int;
    get_local_md: fn(AgentH, *mut *mut c_void, *mut usize) -> c_int;
    load_remote_md: fn(AgentH, *const c_void, usize, *mut *mut c_char) -> c_int;
    invalidate_remote_md: fn(AgentH, *const c_char) -> c_int;
    create_xfer_dlist: fn(c_int, *mut XferDlistH) -> c_int;
    xfer_dlist_add_desc: fn(XferDlistH, usize, usize, u64) -> c_int;
    xfer_dlist_clear: fn(XferDlistH) -> c_int;
    destroy_xfer_dlist: fn(XferDlistH) -> c_int;
    create_opt_args: fn(*mut OptArgsH) -> c_int;
    opt_args_set_notif_msg: fn(OptArgsH, *const c_void, usize) -> c_int;
    opt_args_set_has_notif: fn(OptArgsH, bool) -> c_int;
    destroy_opt_args: fn(OptArgsH) -> c_int;
    create_xfer_req: fn(AgentH, c_int, XferDlistH, XferDlistH, *const c_char, *mut XferReqH, OptArgsH) -> c_int;
    prep_xfer_dlist: fn(AgentH, *const c_char, XferDlistH, *mut XferDlistHandleH, OptArgsH) -> c_int;
    release_xfer_dlist_handle: fn(AgentH, XferDlistHandleH) -> c_int;
    make_xfer_req: fn(
        AgentH, c_int, XferDlistHandleH, *const c_int, usize, XferDlistHandleH, *const c_int, usize,
        *mut XferReqH, OptArgsH,
    ) -> c_int;
    post_xfer_req: fn(AgentH, XferReqH, OptArgsH) -> c_int;
    get_xfer_status: fn(AgentH, XferReqH) -> c_int;
    release_xfer_req: fn(AgentH, XferReqH) -> c_int;
    destroy_xfer_req: fn(XferReqH) -> c_int;
    gen_notif: fn(AgentH, *const c_char, *const c_void, usize, OptArgsH) -> c_int;
    create_notif_map: fn(*mut NotifMapH) -> c_int;
    destroy_notif_map: fn(NotifMapH) -> c_int;
    get_notifs: fn(AgentH, NotifMapH, OptArgsH) -> c_int;
    notif_map_size: fn(NotifMapH, *mut usize) -> c_int;
    notif_map_get_agent_at: fn(NotifMapH, usize, *mut *const c_char) -> c_int;
    notif_map_get_notifs_size: fn(NotifMapH, *const c_char, *mut usize) -> c_int;
    notif_map_get_notif: fn(NotifMapH, *const c_char, usize, *mut *const c_void, *mut usize) -> c_int;
    notif_map_clear: fn(NotifMapH) -> c_int;
}

impl fmt::Debug for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Api").field("functions", &SYMBOLS.len()).finish_non_exhaustive()
    }
}

/// Looks one symbol up, recording its name (without the NUL) when it is missing.
///
/// # Safety
///
/// `T` must be the symbol's true type, and `lib` must never be unloaded while the returned
/// value is used.
unsafe fn lookup<T: Copy>(lib: &DlLibrary, name: &str, missing: &mut Vec<String>) -> Option<T> {
    // SAFETY: forwarded from this function's contract.
    match unsafe { lib.get::<T>(name.as_bytes()) } {
        Ok(symbol) => Some(*symbol),
        Err(_) => {
            missing.push(name.trim_end_matches('\0').to_owned());
            None
        }
    }
}

extern "C" {
    /// The C library's `free`: `get_local_md` and `load_remote_md` return `malloc`/`strdup`
    /// memory that the caller frees (as NIXL's own Rust bindings do).
    fn free(ptr: *mut c_void);
}

/// Frees memory the C API allocated with `malloc`/`strdup`.
///
/// # Safety
///
/// `ptr` is null or came from the C API as caller-owned `malloc` memory, and is not used again.
pub(crate) unsafe fn free_c(ptr: *mut c_void) {
    // SAFETY: forwarded; libnixl_capi.so and this process share glibc's allocator.
    unsafe { free(ptr) }
}

/// A loaded, checked `libnixl_capi.so`. Cheap to clone; NIXL is never unloaded.
#[derive(Clone)]
pub struct Library {
    api: Arc<Api>,
    path: PathBuf,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library")
            .field("path", &self.path)
            .field("symbols", &SYMBOLS.len())
            .finish()
    }
}

impl Library {
    /// Loads the C API from `path`, which must be absolute (the wheel's
    /// `.nixl_cuXX.mesonpy.libs/libnixl_capi.so`; its RPATH finds `libnixl.so`, the bundled UCX
    /// and the plugins, so no `LD_LIBRARY_PATH` is needed).
    ///
    /// Resolves every function in [`SYMBOLS`] now and fails naming all that are missing, and
    /// refuses NIXL's stub library. The library is opened `RTLD_NOW | RTLD_GLOBAL` and never
    /// closed: UCX keeps process-wide state and threads that must not lose their code, and a
    /// later bare `dlopen("libnixl_capi.so")` in the process then finds this same copy.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let path = path.as_ref();
        if !path.is_absolute() {
            return Err(LoadError::NotAbsolute { path: path.to_owned() });
        }
        // SAFETY: loading runs the library's initialisers: those of NIXL's C API, libnixl and
        // the UCX it bundles, which are sound to run in any process (NIXL's Python wheel does
        // the same). The handle is leaked below, so the library stays mapped for good.
        let lib = unsafe { DlLibrary::open(Some(path.as_os_str()), RTLD_NOW | RTLD_GLOBAL) }
            .map_err(|e| LoadError::Open { path: path.to_owned(), reason: e.to_string() })?;
        let api = match Api::resolve(&lib) {
            Ok(api) => api,
            Err(missing) => {
                return Err(LoadError::MissingSymbols { path: path.to_owned(), missing });
            }
        };
        // Never dlclose: the function pointers in `api` point into it from now on.
        let _handle = lib.into_raw();
        // SAFETY: `is_stub` takes no arguments and only returns a constant.
        if unsafe { (api.is_stub)() } {
            return Err(LoadError::Stub { path: path.to_owned() });
        }
        Ok(Self { api: Arc::new(api), path: path.to_owned() })
    }

    /// Loads the library named by [`CAPI_PATH_ENV`] (`KVPUSH_NIXL_CAPI`). Python passes the path
    /// of the installed wheel's library to [`Library::load`] instead; this is for Rust tests,
    /// benches and tools.
    pub fn discover() -> Result<Self, LoadError> {
        match std::env::var_os(CAPI_PATH_ENV) {
            Some(path) if !path.is_empty() => Self::load(Path::new::<OsStr>(&path)),
            _ => Err(LoadError::NotConfigured),
        }
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn api(&self) -> &Arc<Api> {
        &self.api
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbol_list_has_every_table_entry_once() {
        let mut names = SYMBOLS.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SYMBOLS.len(), "duplicate symbol");
        assert!(SYMBOLS.iter().all(|s| s.starts_with("nixl_capi_")));
        assert!(SYMBOLS.contains(&"nixl_capi_create_configured_agent"));
        assert_eq!(
            std::mem::size_of::<Api>(),
            SYMBOLS.len() * std::mem::size_of::<usize>(),
            "one function pointer per symbol"
        );
    }

    #[test]
    fn relative_paths_are_refused() {
        let err = Library::load("libnixl_capi.so").unwrap_err();
        assert!(matches!(err, LoadError::NotAbsolute { .. }), "{err}");
        assert!(err.to_string().contains("absolute"), "{err}");
    }
}
