//! The iSCSI target serving a RAM-backed pool volume in process, driven by libiscsi's
//! own tools (Debian `libiscsi-bin`): discovery with iscsi-ls, INQUIRY with iscsi-inq,
//! READ CAPACITY(16) with iscsi-readcapacity16, a subset of iscsi-test-cu, and access
//! control (initiator allowlist, CHAP one-way and mutual) as libiscsi's initiator meets
//! it.
//!
//! A tool that is missing skips its test with "SKIP: ..." outside CI; in CI (`CI` set)
//! it fails the test, so a runner without the package cannot pass silently.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Instant;

use tessera_device::{BlockDevice, RamDevice};
use tessera_export::budget::{BufferBudget, ListenerCap};
use tessera_export::{Export, ExportTarget};
use tessera_iscsi::accept::accept_loop;
use tessera_iscsi::auth::{Access, Chap, Credentials};
use tessera_iscsi::target::Target;
use tessera_pool::{Pool, PoolOptions, Volume};
use tessera_qos::{QosLimits, VolumeQos};
use tessera_testkit::blockio::{core, read, write};
use tessera_testkit::node::{cunit_counts, require_tool, run_tool};
use tessera_testkit::reactor::ReactorThread;

const IQN: &str = "iqn.2026-11.io.tessera:test";
const VOL: u64 = 64 << 20;

struct Served {
    _pool: Pool,
    vol: Arc<Volume>,
    target: Arc<Target<Volume>>,
    _core: ReactorThread,
    addr: String,
}

impl Served {
    fn url(&self, lun: u32) -> String {
        format!("iscsi://{}/{IQN}/{lun}", self.addr)
    }
}

/// A pool on a RAM device with one volume, served as LUN 0 of [`IQN`] on a loopback
/// port of one reactor core.
fn serve() -> Served {
    serve_with(Access::default())
}

/// [`serve`], with `access` controlling who may log in to [`IQN`].
fn serve_with(access: Access) -> Served {
    let dev: Arc<dyn BlockDevice> = RamDevice::new(VOL + (64 << 20)).unwrap();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    let vol = pool.create_volume("v", VOL).unwrap();
    let target = Target::new();
    target
        .add_target_with_access(
            IQN,
            vec![Export {
                target: vol.clone(),
                qos: Arc::new(VolumeQos::new(QosLimits::default(), Instant::now())),
            }],
            access,
        )
        .unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    target.add_portal(addr.clone());
    let core = ReactorThread::start();
    let mailbox = core.mailbox.clone();
    let cap_addr = addr.clone();
    let served = target.clone();
    std::thread::spawn(move || {
        accept_loop(
            l,
            target,
            ListenerCap::new("iscsi", cap_addr, 64),
            BufferBudget::unlimited(),
            move || mailbox.clone(),
        )
    });
    Served {
        _pool: pool,
        vol,
        target: served,
        _core: core,
        addr,
    }
}

#[test]
fn iscsi_ls_discovers_the_target_and_its_lun() {
    if !require_tool("iscsi-ls") {
        return;
    }
    let s = serve();
    let (ok, out) = run_tool("iscsi-ls", &["-s", &format!("iscsi://{}", s.addr)]);
    assert!(ok, "iscsi-ls failed:\n{out}");
    assert!(out.contains(IQN), "target not listed:\n{out}");
    assert!(out.contains(&s.addr), "portal not listed:\n{out}");
    assert!(out.contains("Lun:0"), "LUN 0 not listed:\n{out}");
}

#[test]
fn iscsi_inq_and_readcapacity16_describe_the_volume() {
    if !require_tool("iscsi-inq") || !require_tool("iscsi-readcapacity16") {
        return;
    }
    let s = serve();
    let (ok, out) = run_tool("iscsi-inq", &[&s.url(0)]);
    assert!(ok, "iscsi-inq failed:\n{out}");
    assert!(out.contains("TESSERA"), "vendor not reported:\n{out}");
    let (ok, out) = run_tool("iscsi-inq", &["-e", "1", "-c", "0xb2", &s.url(0)]);
    assert!(ok, "iscsi-inq VPD B2 failed:\n{out}");
    let (ok, out) = run_tool("iscsi-readcapacity16", &[&s.url(0)]);
    assert!(ok, "iscsi-readcapacity16 failed:\n{out}");
    assert!(
        out.contains(&format!("Total Size:{VOL}")) || out.contains(&VOL.to_string()),
        "size not reported:\n{out}"
    );
    assert!(
        out.contains("LBPME:1"),
        "thin provisioning not reported:\n{out}"
    );
    // A LUN that does not exist, and a target that does not exist.
    let (ok, _) = run_tool("iscsi-readcapacity16", &[&s.url(3)]);
    assert!(!ok, "a missing LUN answered READ CAPACITY");
    let (ok, _) = run_tool(
        "iscsi-inq",
        &[&format!("iscsi://{}/iqn.2026-11.io.tessera:nope/0", s.addr)],
    );
    assert!(!ok, "a login to an unknown target succeeded");
    // The volume still serves I/O in process afterwards.
    let mut io = core();
    let mut h = s.vol.open_handle();
    assert_eq!(write(&mut io, &mut h, 0, &[7u8; 4096]), 0);
    assert_eq!(read(&mut io, &mut h, 0, 4096).unwrap(), vec![7u8; 4096]);
}

/// One `iscsi-test-cu --test=TEST` run against `url` with `--dataloss` (write tests
/// only write with it; the volume is scratch) and the given initiator names (the second
/// for the tests that need two initiators): CUnit's counts, the lines libiscsi marked
/// "[SKIPPED]", and the whole output.
struct CuRun {
    passed: u32,
    failed: u32,
    skipped: Vec<String>,
    out: String,
}

fn test_cu(url: &str, test: &str, initiators: &[&str]) -> CuRun {
    let mut args = vec!["--dataloss".to_string()];
    for (flag, name) in ["--initiator-name", "--initiator-name-2"]
        .iter()
        .zip(initiators)
    {
        args.push(flag.to_string());
        args.push(name.to_string());
    }
    args.push(format!("--test={test}"));
    args.push(url.to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_, out) = run_tool("iscsi-test-cu", &args);
    let Some((passed, failed)) = cunit_counts(&out) else {
        panic!("{test}: no CUnit summary:\n{out}");
    };
    let skipped = out
        .lines()
        .filter(|l| l.contains("[SKIPPED]"))
        .map(|l| l.trim().to_string())
        .collect();
    CuRun {
        passed,
        failed,
        skipped,
        out,
    }
}

#[test]
fn iscsi_test_cu_block_command_subset_passes() {
    if !require_tool("iscsi-test-cu") {
        return;
    }
    let s = serve();
    let mut failed_total = 0;
    let mut report = String::new();
    for t in [
        "SCSI.TestUnitReady",
        "SCSI.Inquiry",
        "SCSI.ReadCapacity10",
        "SCSI.ReadCapacity16",
        "SCSI.Read10",
        "SCSI.Write10",
        "SCSI.Read16",
        "SCSI.Write16",
        "SCSI.Read6",
        "SCSI.Read12",
        "SCSI.Write12",
        "SCSI.ModeSense6",
        "SCSI.Unmap",
        "SCSI.WriteSame16",
        "SCSI.Mandatory",
        "iSCSI.iSCSIcmdsn",
        "iSCSI.iSCSIResiduals",
        "iSCSI.iSCSITMF",
    ] {
        let r = test_cu(&s.url(0), t, &["iqn.2026-11.io.tessera:test-initiator"]);
        // CUnit counts a test libiscsi skipped (the target lacks the command) as
        // passed: say how many of the passes were skips ("Test: X ...    [SKIPPED]";
        // a skip notice after "passed" belongs to the teardown's probes).
        let skipped = r
            .skipped
            .iter()
            .filter_map(|l| l.strip_prefix("Test:"))
            .filter_map(|l| l.split_once("..."))
            .filter(|(_, r)| r.trim_start().starts_with("[SKIPPED]"))
            .count();
        report.push_str(&format!(
            "{t}: {} passed (of which {skipped} skipped), {} failed\n",
            r.passed, r.failed
        ));
        if r.failed > 0 {
            eprintln!("{t} output:\n{}", r.out);
        }
        failed_total += r.failed;
    }
    eprintln!("{report}");
    assert_eq!(failed_total, 0, "iscsi-test-cu failures:\n{report}");
}

/// The two initiator names of the tests that need a second I_T nexus.
const PR_INITIATORS: [&str; 2] = [
    "iqn.2026-11.io.tessera:pr-initiator-1",
    "iqn.2026-11.io.tessera:pr-initiator-2",
];

/// Run each of `tests` with two initiators; every one must pass, and none may be
/// skipped ("[SKIPPED] ... not supported" is how libiscsi passes a target that lacks
/// the command) except where a line names one of `may_skip`. Returns the report.
fn all_pass_unskipped(url: &str, tests: &[&str], may_skip: &[&str]) -> String {
    let mut failed_total = 0;
    let mut report = String::new();
    for t in tests {
        let r = test_cu(url, t, &PR_INITIATORS);
        let skipped = r
            .skipped
            .iter()
            .filter(|l| !may_skip.iter().any(|m| l.contains(m)))
            .count();
        report.push_str(&format!(
            "{t}: {} passed, {} failed, {skipped} skipped\n",
            r.passed, r.failed
        ));
        if r.failed > 0 || skipped > 0 {
            eprintln!("{t} output:\n{}", r.out);
        }
        failed_total += usize::try_from(r.failed).unwrap() + skipped;
    }
    eprintln!("{report}");
    assert_eq!(failed_total, 0, "iscsi-test-cu failures:\n{report}");
    report
}

/// libiscsi's persistent reservation tests (PERSISTENT RESERVE IN/OUT), two initiators
/// (the second from `--initiator-name-2`) on the same LUN; every one must pass, and
/// none may be skipped as not supported.
#[test]
fn iscsi_test_cu_persistent_reservations_pass() {
    if !require_tool("iscsi-test-cu") {
        return;
    }
    let s = serve();
    all_pass_unskipped(
        &s.url(0),
        &[
            "SCSI.PrinReadKeys",
            "SCSI.PrinServiceactionRange",
            "SCSI.PrinReportCapabilities",
            "SCSI.ProutRegister",
            "SCSI.ProutReserve",
            "SCSI.ProutClear",
            "SCSI.ProutPreempt",
        ],
        &[],
    );
    // Registrations outlive the sessions that made them: the unit's state is the one
    // all seven runs (one process, one login each) changed, every registration and
    // unregistration a step of its generation.
    // Once every connection has finished (a closed connection's task lives until its
    // 1 s login tick has fired), only the target holds the unit's state.
    let t = s.target.target(IQN).unwrap();
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    while t.sessions() != 0 && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let unit = tessera_iscsi::lu::LuShared::of(s.vol.identity());
    assert!(Arc::ptr_eq(&unit, &t.shared[0]));
    let keys = unit.pr_in(tessera_iscsi::pr::READ_KEYS).unwrap();
    let generation = u32::from_be_bytes(keys[..4].try_into().unwrap());
    eprintln!("PRgeneration {generation}");
    assert!(generation >= 30, "PRgeneration {generation}");
    assert_eq!(&keys[4..8], &[0, 0, 0, 0], "registrations left: {keys:?}");
}

/// SPC-2 reservations (RESERVE(6) / RELEASE(6)) across two initiators, released by
/// RELEASE, logout, a dropped connection, LUN RESET and TARGET WARM RESET; and REPORT
/// SUPPORTED OPERATION CODES one command at a time, for every opcode it lists. TARGET
/// COLD RESET is not supported (libiscsi skips that one test, saying so).
#[test]
fn iscsi_test_cu_reserve6_and_supported_opcodes_pass() {
    if !require_tool("iscsi-test-cu") {
        return;
    }
    let s = serve();
    all_pass_unskipped(
        &s.url(0),
        &["SCSI.Reserve6", "SCSI.ReportSupportedOpcodes"],
        &["ColdReset"],
    );
}

const HOST1: &str = "iqn.2026-11.io.example:host1";
const HOST2: &str = "iqn.2026-11.io.example:host2";
const USER: &str = "alice";
const SECRET: &str = "initiator-secret-1";
const MUTUAL_USER: &str = "tessera";
const MUTUAL_SECRET: &str = "target-secret-222";

fn chap(mutual: bool) -> Access {
    Access {
        allowed_initiators: Vec::new(),
        chap: Some(Chap {
            initiator: Credentials {
                user: USER.into(),
                secret: SECRET.as_bytes().to_vec(),
            },
            mutual: mutual.then(|| Credentials {
                user: MUTUAL_USER.into(),
                secret: MUTUAL_SECRET.as_bytes().to_vec(),
            }),
        }),
    }
}

impl Served {
    /// LUN 0's URL with CHAP credentials `USER%SECRET@` and URL arguments.
    fn chap_url(&self, creds: &str, args: &str) -> String {
        format!("iscsi://{creds}@{}/{IQN}/0{args}", self.addr)
    }
}

#[test]
fn one_way_chap_admits_the_right_secret_only() {
    if !require_tool("iscsi-inq") {
        return;
    }
    let s = serve_with(chap(false));
    let (ok, out) = run_tool("iscsi-inq", &[&s.chap_url(&format!("{USER}%{SECRET}"), "")]);
    assert!(ok, "the right secret was refused:\n{out}");
    assert!(out.contains("TESSERA"), "no INQUIRY data:\n{out}");
    for (what, url) in [
        (
            "a wrong secret",
            s.chap_url(&format!("{USER}%wrong-secret-123"), ""),
        ),
        ("a wrong user", s.chap_url(&format!("mallory%{SECRET}"), "")),
        ("no credentials", s.url(0)),
    ] {
        let (ok, out) = run_tool("iscsi-inq", &[&url]);
        assert!(!ok, "{what} was let in:\n{out}");
        // libiscsi prints the Login Response status: 0x0201.
        assert!(
            out.contains("Authentication failure"),
            "{what}: not refused as an authentication failure:\n{out}"
        );
    }
    // What the node's metrics show (tessera_iscsi_*): one login, three refusals for
    // authentication, and no session left once the tool is gone.
    let t = s.target.target(IQN).unwrap();
    assert_eq!(t.logins(), 1);
    let refused = s.target.refusals.figures();
    assert_eq!(refused[0], ("authentication", 3), "{refused:?}");
    assert!(refused[1..].iter().all(|&(_, n)| n == 0), "{refused:?}");
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    while t.sessions() != 0 && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(t.sessions(), 0, "a session outlived its connection");
}

#[test]
fn mutual_chap_proves_the_target_to_the_initiator() {
    if !require_tool("iscsi-inq") {
        return;
    }
    let s = serve_with(chap(true));
    let creds = format!("{USER}%{SECRET}");
    let good = format!("?target_user={MUTUAL_USER}&target_password={MUTUAL_SECRET}");
    let (ok, out) = run_tool("iscsi-inq", &[&s.chap_url(&creds, &good)]);
    assert!(ok, "mutual CHAP with the right secrets failed:\n{out}");
    // The initiator holds another target secret: it must refuse the target.
    let bad = format!("?target_user={MUTUAL_USER}&target_password=not-the-target-one");
    let (ok, out) = run_tool("iscsi-inq", &[&s.chap_url(&creds, &bad)]);
    assert!(
        !ok,
        "the initiator accepted a target with the wrong secret:\n{out}"
    );
    assert!(
        out.contains("Invalid CHAP_R response from the target"),
        "refused, but not by the initiator's check of the target:\n{out}"
    );
    // One-way CHAP against a target that also has mutual credentials still works.
    let (ok, out) = run_tool("iscsi-inq", &[&s.chap_url(&creds, "")]);
    assert!(ok, "one-way CHAP failed:\n{out}");
}

#[test]
fn the_allowlist_admits_listed_initiators_only() {
    if !require_tool("iscsi-inq") || !require_tool("iscsi-ls") {
        return;
    }
    let s = serve_with(Access {
        allowed_initiators: vec![HOST1.into()],
        chap: None,
    });
    let (ok, out) = run_tool("iscsi-inq", &["-i", HOST1, &s.url(0)]);
    assert!(ok, "a listed initiator was refused:\n{out}");
    let (ok, out) = run_tool("iscsi-inq", &["-i", HOST2, &s.url(0)]);
    assert!(!ok, "an initiator off the list was let in:\n{out}");
    // Status 0x0202 (RFC 7143 §11.13.5).
    assert!(out.contains("Authorization failure"), "{out}");
    assert_eq!(s.target.refusals.figures()[1], ("authorization", 1));
    // Discovery lists the target to the initiators that may log in to it only.
    let portal = format!("iscsi://{}", s.addr);
    let (ok, out) = run_tool("iscsi-ls", &["-i", HOST1, &portal]);
    assert!(
        ok && out.contains(IQN),
        "not listed to a listed initiator:\n{out}"
    );
    let (_, out) = run_tool("iscsi-ls", &["-i", HOST2, &portal]);
    assert!(
        !out.contains(IQN),
        "listed to an initiator off the list:\n{out}"
    );
}
