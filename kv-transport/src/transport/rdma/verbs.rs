//! Safe owners of the raw verbs objects the RDMA transport uses (through `ibverbs-sys`).
//!
//! Owns: [`Device`] (an opened device, one port, its protection domain), [`Region`] (page-
//! aligned memory with its registrations), [`QueuePair`] (an RC queue pair with its own
//! completion queue) and the translation of verbs failures into [`Error`].
//! Invariants: every object keeps what it was created from alive (`Arc<Device>`), and is
//! destroyed before it: a queue pair before its completion queue, registrations before
//! their memory, everything before the protection domain and the device context.
//! libibverbs documents its verbs as thread-safe, which is what the `Send`/`Sync` impls
//! rely on; the data path still keeps each queue pair to one task.

use std::alloc::Layout;
use std::ffi::CStr;
use std::io;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::error::{Error, Result};
use crate::transport::rdma::setup::QpInfo;
use crate::transport::select::RdmaConfig as DeviceSelector;

fn unavailable(reason: String) -> Error {
    Error::RdmaUnavailable { reason }
}

fn verbs_err(op: &'static str, source: io::Error) -> Error {
    Error::Rdma { op, source }
}

/// Maps an errno-style return (0 or an errno) to a result.
fn check(op: &'static str, rc: i32) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(verbs_err(op, io::Error::from_raw_os_error(rc)))
    }
}

/// An open device context, the port it uses and one protection domain.
pub struct Device {
    ctx: NonNull<ffi::ibv_context>,
    pd: NonNull<ffi::ibv_pd>,
    pub name: String,
    pub port: u8,
    pub gid_index: u8,
    lid: u16,
    mtu: u8,
    gid: [u8; 16],
}

// SAFETY: the context and PD are only used through libibverbs calls, which are thread-safe;
// the struct holds no Rust references into them.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    /// Opens the device `sel` names. Any reason it cannot be used (no kernel support, no
    /// device, port down, bad GID index) is [`Error::RdmaUnavailable`] naming that reason.
    pub fn open(sel: &DeviceSelector) -> Result<Arc<Device>> {
        let mut n = 0i32;
        // SAFETY: plain FFI call; `n` outlives it.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(unavailable(format!(
                "no RDMA device: {}",
                io::Error::last_os_error()
            )));
        }
        // SAFETY: a non-null list holds `n` valid device pointers until it is freed below.
        let devices = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
        let names: Vec<String> = devices.iter().map(|&d| device_name(d)).collect();
        let chosen = match &sel.device {
            None => devices.first().copied().zip(names.first().cloned()),
            Some(want) => names
                .iter()
                .position(|n| n == want)
                .map(|i| (devices[i], names[i].clone())),
        };
        let opened = chosen.map(|(dev, name)| {
            // SAFETY: `dev` comes from the live list; the context does not borrow the list.
            (unsafe { ffi::ibv_open_device(dev) }, name)
        });
        let open_error = io::Error::last_os_error();
        // SAFETY: `list` came from ibv_get_device_list; opened contexts stay valid after.
        unsafe { ffi::ibv_free_device_list(list) };
        let (ctx, name) = match opened {
            None if names.is_empty() => {
                return Err(unavailable("no RDMA device: none found".into()))
            }
            None => {
                return Err(unavailable(format!(
                    "no RDMA device named {:?} (found: {})",
                    sel.device.as_deref().unwrap_or(""),
                    names.join(", ")
                )))
            }
            Some((ctx, name)) => match NonNull::new(ctx) {
                Some(ctx) => (ctx, name),
                None => {
                    return Err(unavailable(format!(
                        "cannot open RDMA device {name}: {open_error}"
                    )))
                }
            },
        };
        Self::configure(ctx, name, sel)
    }

    /// Queries the port and GID and allocates the PD; closes `ctx` on failure.
    fn configure(ctx: NonNull<ffi::ibv_context>, name: String, sel: &DeviceSelector) -> Result<Arc<Device>> {
        let close = |e: Error| {
            // SAFETY: `ctx` was opened by us and nothing else refers to it yet.
            unsafe { ffi::ibv_close_device(ctx.as_ptr()) };
            e
        };
        let mut port = ffi::ibv_port_attr::default();
        // SAFETY: `port` is a valid ibv_port_attr (the exported ibv_query_port takes the same
        // layout under its compat name, as the verbs.h macro does).
        let rc = unsafe { ffi::ibv_query_port(ctx.as_ptr(), sel.port, &mut port as *mut _ as *mut _) };
        if rc != 0 {
            return Err(close(unavailable(format!(
                "RDMA device {name}: cannot query port {}: {}",
                sel.port,
                io::Error::from_raw_os_error(rc)
            ))));
        }
        if port.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(close(unavailable(format!(
                "RDMA device {name}: port {} is not active (state {})",
                sel.port, port.state
            ))));
        }
        let mut gid = ffi::ibv_gid::default();
        // SAFETY: `gid` is a valid out-parameter for the duration of the call.
        let rc = unsafe { ffi::ibv_query_gid(ctx.as_ptr(), sel.port, i32::from(sel.gid_index), &mut gid) };
        if rc != 0 {
            return Err(close(unavailable(format!(
                "RDMA device {name}: no GID at index {} of port {}: {}",
                sel.gid_index,
                sel.port,
                io::Error::last_os_error()
            ))));
        }
        // SAFETY: every bit pattern of the union is a valid byte array.
        let gid = unsafe { gid.raw };
        // SAFETY: `ctx` is open.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.as_ptr()) };
        let Some(pd) = NonNull::new(pd) else {
            return Err(close(unavailable(format!(
                "RDMA device {name}: cannot allocate a protection domain: {}",
                io::Error::last_os_error()
            ))));
        };
        Ok(Arc::new(Device {
            ctx,
            pd,
            name,
            port: sel.port,
            gid_index: sel.gid_index,
            lid: port.lid,
            mtu: u8::try_from(port.active_mtu).unwrap_or(1),
            gid,
        }))
    }
}

impl Device {
    /// The protection domain, for registrations made outside this module.
    pub(crate) fn pd_ptr(&self) -> *mut ffi::ibv_pd {
        self.pd.as_ptr()
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every object created from the PD and context holds an Arc<Device>, so none
        // is left when this runs.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd.as_ptr());
            ffi::ibv_close_device(self.ctx.as_ptr());
        }
    }
}

fn device_name(dev: *mut ffi::ibv_device) -> String {
    // SAFETY: `dev` is a live device; the name is a NUL-terminated string it owns.
    let p = unsafe { ffi::ibv_get_device_name(dev) };
    if p.is_null() {
        return "?".into();
    }
    // SAFETY: non-null, NUL-terminated, valid while the list is.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Page-aligned, zeroed memory and the registrations that cover parts of it.
pub struct Region {
    // Declared first: registrations are dropped (deregistered) before the memory is freed.
    mrs: Vec<MemoryRegistration>,
    ptr: NonNull<u8>,
    layout: Layout,
    _device: Arc<Device>,
}

struct MemoryRegistration(NonNull<ffi::ibv_mr>);

impl Drop for MemoryRegistration {
    fn drop(&mut self) {
        // SAFETY: registered by Region::register; its queue pairs are gone (they hold the
        // Region alive through the lease owner, see link.rs).
        unsafe { ffi::ibv_dereg_mr(self.0.as_ptr()) };
    }
}

// SAFETY: the memory is only reached through raw pointers whose use the owner (link.rs)
// serialises with the slot protocol; the registrations are libibverbs objects.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

/// Keys of one registration.
#[derive(Clone, Copy, Debug)]
pub struct Keys {
    pub lkey: u32,
    pub rkey: u32,
}

impl Region {
    /// `parts` registrations of `part_bytes` each, back to back; `remote_write` lets peers
    /// RDMA WRITE into them.
    pub fn register(device: &Arc<Device>, parts: u32, part_bytes: usize, remote_write: bool) -> Result<(Region, Vec<Keys>)> {
        let len = part_bytes
            .checked_mul(parts as usize)
            .filter(|&l| l > 0)
            .ok_or(Error::InvalidArgument { what: "RDMA region size is zero or overflows" })?;
        let layout = Layout::from_size_align(len, 4096)
            .map_err(|_| Error::InvalidArgument { what: "RDMA region too large" })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or(Error::Rdma {
            op: "allocating RDMA memory",
            source: io::Error::from(io::ErrorKind::OutOfMemory),
        })?;
        let mut region = Region {
            mrs: Vec::with_capacity(parts as usize),
            ptr,
            layout,
            _device: device.clone(),
        };
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        let mut keys = Vec::with_capacity(parts as usize);
        for i in 0..parts as usize {
            // SAFETY: the range lies inside the allocation, which outlives the registration
            // (field order of Region).
            let mr = unsafe {
                ffi::ibv_reg_mr(
                    device.pd.as_ptr(),
                    region.ptr.as_ptr().add(i * part_bytes).cast(),
                    part_bytes,
                    access.0 as i32,
                )
            };
            let mr = NonNull::new(mr).ok_or_else(|| verbs_err("registering memory", io::Error::last_os_error()))?;
            // SAFETY: a registered MR is valid until deregistered.
            let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
            region.mrs.push(MemoryRegistration(mr));
            keys.push(Keys { lkey, rkey });
        }
        Ok((region, keys))
    }

    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.mrs.clear();
        // SAFETY: allocated in `register` with this layout; no registration is left.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// One finished work request.
#[derive(Clone, Copy, Debug)]
pub struct Completion {
    pub wr_id: u64,
    pub byte_len: u32,
    /// Immediate data in host order, when the completion carried some.
    pub imm: Option<u32>,
}

/// One RDMA WRITE WITH IMMEDIATE: `len` bytes at `local` (registered under `lkey`) to
/// `remote_addr` (registered on the peer under `rkey`), announced with `imm`.
#[derive(Clone, Copy, Debug)]
pub struct WriteImm {
    pub wr_id: u64,
    /// The local address: a host pointer, or a dma-buf registration's I/O virtual address.
    pub local: u64,
    pub len: u32,
    pub lkey: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub imm: u32,
}

/// An RC queue pair and the completion queue both its queues report to.
pub struct QueuePair {
    qp: NonNull<ffi::ibv_qp>,
    cq: NonNull<ffi::ibv_cq>,
    psn: u32,
    device: Arc<Device>,
}

// SAFETY: libibverbs objects used only through thread-safe verbs calls.
unsafe impl Send for QueuePair {}
unsafe impl Sync for QueuePair {}

/// Retry settings: a peer that stops acknowledging fails the link in about half a second
/// (4.096 µs * 2^14 per try, 7 tries) instead of hanging.
const ACK_TIMEOUT: u8 = 14;
const RETRY_COUNT: u8 = 7;
/// 7 means "retry forever" on receiver-not-ready; credits make RNR impossible, so this only
/// matters against a broken peer, which the deadline above the link handles.
const RNR_RETRY: u8 = 7;
const MIN_RNR_TIMER: u8 = 12;

impl QueuePair {
    /// Creates the CQ and QP and moves the QP to INIT. `remote_write`: peers may RDMA WRITE
    /// into this end's registered memory.
    pub fn create(device: &Arc<Device>, max_send: u32, max_recv: u32, remote_write: bool) -> Result<QueuePair> {
        let depth = i32::try_from(max_send + max_recv).unwrap_or(i32::MAX);
        // SAFETY: the context is open; no channel, no context pointer.
        let cq = unsafe { ffi::ibv_create_cq(device.ctx.as_ptr(), depth, ptr::null_mut(), ptr::null_mut(), 0) };
        let cq = NonNull::new(cq).ok_or_else(|| verbs_err("creating a completion queue", io::Error::last_os_error()))?;
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq.as_ptr(),
            recv_cq: cq.as_ptr(),
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: max_send.max(1),
                max_recv_wr: max_recv.max(1),
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: PD and CQ are live; `init` outlives the call.
        let qp = unsafe { ffi::ibv_create_qp(device.pd.as_ptr(), &mut init) };
        let Some(qp) = NonNull::new(qp) else {
            let e = verbs_err("creating a queue pair", io::Error::last_os_error());
            // SAFETY: nothing else uses the CQ.
            unsafe { ffi::ibv_destroy_cq(cq.as_ptr()) };
            return Err(e);
        };
        let qp = QueuePair {
            qp,
            cq,
            psn: random_psn(),
            device: device.clone(),
        };
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: device.port,
            qp_access_flags: access.0,
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ffi::ibv_qp_attr_mask::IBV_QP_PORT
            | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        qp.modify("moving a queue pair to INIT", &mut attr, mask)?;
        Ok(qp)
    }

    fn modify(&self, op: &'static str, attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask) -> Result<()> {
        // SAFETY: the QP is live and `attr` outlives the call.
        check(op, unsafe { ffi::ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as i32) })
    }

    /// What the peer needs to connect to this queue pair.
    pub fn info(&self) -> QpInfo {
        QpInfo {
            // SAFETY: `qp_num` is set at creation and never changes.
            qpn: unsafe { (*self.qp.as_ptr()).qp_num },
            psn: self.psn,
            lid: self.device.lid,
            mtu: self.device.mtu,
            gid: self.device.gid,
        }
    }

    /// INIT -> RTR -> RTS towards `remote`. Always routes globally (GRH): required on RoCE
    /// and harmless within an InfiniBand subnet.
    pub fn connect(&self, remote: &QpInfo) -> Result<()> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: u32::from(self.device.mtu.min(remote.mtu).max(1)),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: MIN_RNR_TIMER,
            ah_attr: ffi::ibv_ah_attr {
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                is_global: 1,
                port_num: self.device.port,
                grh: ffi::ibv_global_route {
                    dgid: ffi::ibv_gid { raw: remote.gid },
                    flow_label: 0,
                    sgid_index: self.device.gid_index,
                    hop_limit: 0xff,
                    traffic_class: 0,
                },
                ..Default::default()
            },
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_AV
            | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ffi::ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify("moving a queue pair to RTR", &mut attr, mask)?;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: self.psn,
            timeout: ACK_TIMEOUT,
            retry_cnt: RETRY_COUNT,
            rnr_retry: RNR_RETRY,
            max_rd_atomic: 1,
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify("moving a queue pair to RTS", &mut attr, mask)
    }

    /// Posts a signaled RDMA WRITE WITH IMMEDIATE described by `w`.
    ///
    /// # Safety
    /// `w.local..w.local+w.len` must lie in memory registered with `w.lkey` and must stay
    /// allocated and unmodified until this work request's completion was polled (or the QP
    /// was destroyed).
    pub unsafe fn post_write_imm(&self, w: &WriteImm) -> Result<()> {
        let mut sge = ffi::ibv_sge {
            addr: w.local,
            length: w.len,
            lkey: w.lkey,
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id: w.wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.wr.rdma.remote_addr = w.remote_addr;
        wr.wr.rdma.rkey = w.rkey;
        // verbs defines imm_data as big-endian (__be32).
        wr.__bindgen_anon_1.imm_data = w.imm.to_be();
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: ibv_post_send is static inline in verbs.h; this is its body: the provider's
        // post_send op on the QP's context. `wr` and `sge` outlive the call (the provider
        // copies them into the send queue); the caller guarantees the buffer.
        let rc = unsafe {
            let ctx = (*self.qp.as_ptr()).context;
            match (*ctx).ops.post_send {
                Some(post) => post(self.qp.as_ptr(), &mut wr, &mut bad),
                None => libc_enosys(),
            }
        };
        check("posting an RDMA write", rc)
    }

    /// Posts a receive with no buffer: an RDMA WRITE WITH IMMEDIATE consumes one to report
    /// its arrival, and writes its data where the sender said.
    pub fn post_recv_empty(&self, wr_id: u64) -> Result<()> {
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: ibv_post_recv is static inline in verbs.h; this is its body. No buffer is
        // referenced, and `wr` outlives the call.
        let rc = unsafe {
            let ctx = (*self.qp.as_ptr()).context;
            match (*ctx).ops.post_recv {
                Some(post) => post(self.qp.as_ptr(), &mut wr, &mut bad),
                None => libc_enosys(),
            }
        };
        check("posting a receive", rc)
    }

    /// Takes up to `max` completions without blocking. A completion with an error status
    /// is returned as [`Error::RdmaCompletion`] (the queue pair is then in the error state).
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<()> {
        const BATCH: usize = 16;
        // SAFETY: ibv_wc is plain data; all-zero is a valid value.
        let mut wcs: [ffi::ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        let want = max.min(BATCH) as i32;
        // SAFETY: ibv_poll_cq is static inline in verbs.h; this is its body. `wcs` has room
        // for `want` entries.
        let n = unsafe {
            let ctx = (*self.cq.as_ptr()).context;
            match (*ctx).ops.poll_cq {
                Some(poll) => poll(self.cq.as_ptr(), want, wcs.as_mut_ptr()),
                None => -1,
            }
        };
        if n < 0 {
            return Err(verbs_err("polling a completion queue", io::Error::other("ibv_poll_cq failed")));
        }
        for wc in &wcs[..n as usize] {
            if let Some((status, vendor)) = wc.error() {
                return Err(Error::RdmaCompletion {
                    status: status_str(status),
                    vendor_err: vendor,
                });
            }
            out.push(Completion {
                wr_id: wc.wr_id(),
                byte_len: wc.len() as u32,
                imm: wc.imm_data().map(u32::from_be),
            });
        }
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: the QP goes first, then the CQ it reports to; both were created by us and
        // nothing else refers to them. Outstanding work requests are flushed by destroy.
        unsafe {
            ffi::ibv_destroy_qp(self.qp.as_ptr());
            ffi::ibv_destroy_cq(self.cq.as_ptr());
        }
    }
}

fn libc_enosys() -> i32 {
    38
}

fn status_str(status: ffi::ibv_wc_status::Type) -> String {
    // SAFETY: returns a static NUL-terminated string for any value.
    let p = unsafe { ffi::ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: static string from libibverbs.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A random 24-bit starting PSN, so a stale packet from an earlier QP with the same number
/// is unlikely to be accepted.
fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    (h.finish() as u32) & 0x00ff_ffff
}
