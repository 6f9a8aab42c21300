//! Tests of the per-core runtime itself: joins, continuations, deferral, timers, ring
//! completions and completions sent from other threads.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::core_io::{Continuation, CoreIo, IoOp};
use crate::reactor::{spawn_reactors, Msg, ReactorConfig, Task};
use crate::tag::Tag;

/// Tags of task 0, whose encoding equals `slot`, as plain numbers were before tags had a type.
fn task_tag(slot: u32) -> Tag {
    Tag::task(0, slot)
}

fn core() -> CoreIo {
    CoreIo::new(0, 16, None).expect("io_uring")
}

/// Drive `io` until idle; the task completions in arrival order.
fn drain(io: &mut CoreIo) -> Vec<(u64, i32)> {
    let mut out = Vec::new();
    io.run_until_idle(|_, tag, res| out.push((tag.user_data(), res)));
    out
}

/// A continuation that records what it is called with and completes the parent with
/// `answer` (or, for `on_done`, with the result plus 1000).
#[derive(Default)]
struct Recorder {
    errors: RefCell<Vec<(Tag, u64, i32)>>,
    done: RefCell<Vec<(Tag, u64, i32)>>,
    answer: i32,
}

impl Continuation for Recorder {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        assert!(matches!(op, IoOp::Discard { offset: 7, len: 9 }), "{op:?}");
        self.errors.borrow_mut().push((parent, ctx, res));
        io.complete(parent, self.answer);
    }

    fn on_done(&self, io: &mut CoreIo, parent: Tag, _op: IoOp, ctx: u64, res: i32) {
        self.done.borrow_mut().push((parent, ctx, res));
        if parent != Tag::NO_PARENT {
            io.complete(parent, res + 1000);
        }
    }
}

#[test]
fn a_join_completes_its_parent_once_with_the_first_error() {
    let mut io = core();
    let t = io.join(task_tag(5), 3);
    io.complete(t, 10);
    assert!(drain(&mut io).is_empty(), "two parts still missing");
    io.complete(t, -5);
    io.complete(t, -7);
    assert_eq!(drain(&mut io), vec![(5, -5)]);

    // Nested joins resolve in one call, and every entry is reused afterwards.
    let (slots, _) = io.join_slots();
    let outer = io.join(task_tag(9), 2);
    let inner = io.join(outer, 2);
    io.complete(inner, 1);
    io.complete(inner, 2);
    io.complete(outer, 3);
    assert_eq!(drain(&mut io), vec![(9, 0)]);
    let (after, free) = io.join_slots();
    assert_eq!(after, free, "every join entry is free again");
    assert!(after <= slots.max(2));
}

#[test]
fn a_hooked_operation_passes_success_on_and_gives_errors_to_its_continuation() {
    let mut io = core();
    let rec = Rc::new(Recorder {
        answer: 77,
        ..Default::default()
    });
    let id = io.register_hook(rec.clone());
    let op = IoOp::Discard { offset: 7, len: 9 };

    // Like a join's, a hooked tag's success reaches the parent as 0.
    let ok = io.hooked(task_tag(1), id, op, 42);
    io.complete(ok, 512);
    assert_eq!(drain(&mut io), vec![(1, 0)]);
    assert!(rec.errors.borrow().is_empty());

    let bad = io.hooked(task_tag(2), id, op, 43);
    io.complete(bad, -libc::EIO);
    assert_eq!(drain(&mut io), vec![(2, 77)], "the continuation decides");
    assert_eq!(*rec.errors.borrow(), vec![(task_tag(2), 43, -libc::EIO)]);
}

#[test]
fn a_tracked_operation_reaches_its_continuation_whatever_the_result() {
    let mut io = core();
    let rec = Rc::new(Recorder::default());
    let id = io.register_hook(rec.clone());
    let t = io.tracked(task_tag(3), 2, id, 8);
    io.complete(t, 4096);
    io.complete(t, 4096);
    let u = io.tracked(task_tag(4), 1, id, 9);
    io.complete(u, -libc::ENOSPC);
    assert_eq!(drain(&mut io), vec![(3, 1000), (4, 1000 - libc::ENOSPC)]);
    assert_eq!(
        *rec.done.borrow(),
        vec![(task_tag(3), 8, 0), (task_tag(4), 9, -libc::ENOSPC)]
    );
    assert!(rec.errors.borrow().is_empty());
}

#[test]
fn a_watched_operation_gives_its_continuation_the_raw_result() {
    let mut io = core();
    let rec = Rc::new(Recorder::default());
    let id = io.register_hook(rec.clone());
    // A tracked tag reports success as 0; a watched one passes the byte count through
    // (a socket receive needs it), and errors as they are.
    let t = io.tracked(Tag::NO_PARENT, 1, id, 1);
    io.complete(t, 4096);
    let w = io.watched(id, 2);
    io.complete(w, 4096);
    let e = io.watched(id, 3);
    io.complete(e, -libc::ECONNRESET);
    assert!(
        drain(&mut io).is_empty(),
        "a watched tag completes nothing itself"
    );
    assert_eq!(
        *rec.done.borrow(),
        vec![
            (Tag::NO_PARENT, 1, 0),
            (Tag::NO_PARENT, 2, 4096),
            (Tag::NO_PARENT, 3, -libc::ECONNRESET)
        ]
    );
    let (slots, free) = io.join_slots();
    assert_eq!(slots, free, "every entry is free again");
}

#[test]
fn a_released_hook_is_dropped_once_nothing_is_addressed_to_it_and_its_id_reused() {
    let mut io = core();
    let before = io.hook_count();
    // Nothing outstanding: dropped at once.
    let idle = Rc::new(Recorder::default());
    let id = io.register_hook(idle.clone());
    assert_eq!(io.hook_count(), before + 1);
    io.release_hook(id);
    assert_eq!(Rc::strong_count(&idle), 1, "the core let the hook go");
    assert_eq!(io.hook_count(), before);

    // Operations outstanding (a ring receive, a timer): the hook stays and still gets
    // their completions, and goes with the last one. Its id is the one given back.
    let busy = Rc::new(Recorder::default());
    let id2 = io.register_hook(busy.clone());
    assert_eq!(id2, id, "a released hook's id is reused");
    let w = io.watched(id2, 1);
    let t = io.tracked(Tag::NO_PARENT, 1, id2, 2);
    io.complete_after(Duration::from_millis(1), t, 0);
    io.release_hook(id2);
    assert_eq!(
        Rc::strong_count(&busy),
        2,
        "kept while operations are pending"
    );
    io.complete(w, 4096);
    assert_eq!(Rc::strong_count(&busy), 2, "the timer is still pending");
    drain(&mut io);
    assert_eq!(
        *busy.done.borrow(),
        vec![(Tag::NO_PARENT, 1, 4096), (Tag::NO_PARENT, 2, 0)]
    );
    assert_eq!(
        Rc::strong_count(&busy),
        1,
        "dropped after its last completion"
    );
    assert_eq!(io.hook_count(), before);
    let (slots, free) = io.join_slots();
    assert_eq!(slots, free);
}

#[test]
fn deferred_work_runs_after_what_is_ready_now() {
    let mut io = core();
    let rec = Rc::new(Recorder::default());
    let id = io.register_hook(rec.clone());
    io.defer(task_tag(11));
    io.defer_hook(id, 5);
    io.complete(task_tag(12), 1);
    let round = io.round();
    let mut seen = Vec::new();
    io.run_until_idle(|io, tag, res| seen.push((tag.user_data(), res, io.round())));
    // The ready completion first, in this round; the deferred one in a later round,
    // with 0.
    assert_eq!(seen[0], (12, 1, round));
    assert_eq!(seen[1].0, 11);
    assert_eq!(seen[1].1, 0);
    assert!(seen[1].2 > round, "deferred work waits for the next round");
    assert_eq!(seen.len(), 2, "a deferred continuation completes no task");
    assert_eq!(*rec.done.borrow(), vec![(Tag::NO_PARENT, 5, 0)]);
}

#[test]
fn timers_fire_in_deadline_order_and_background_ones_do_not_hold_the_caller() {
    let mut io = core();
    let t0 = Instant::now();
    io.complete_after(Duration::from_millis(30), task_tag(2), 20);
    io.complete_after(Duration::from_millis(10), task_tag(1), 10);
    let d = io.delayed(task_tag(3), Duration::from_millis(20));
    io.complete(d, -30);
    assert_eq!(drain(&mut io), vec![(1, 10), (3, -30), (2, 20)]);
    assert!(t0.elapsed() >= Duration::from_millis(30));

    // A background timer alone does not keep run_until_idle waiting; it fires in a
    // later call once due.
    io.complete_after_background(Duration::from_millis(20), task_tag(4), 40);
    let t1 = Instant::now();
    assert!(drain(&mut io).is_empty());
    assert!(t1.elapsed() < Duration::from_millis(20));
    std::thread::sleep(Duration::from_millis(25));
    io.complete_after(Duration::ZERO, task_tag(5), 50);
    assert_eq!(drain(&mut io), vec![(4, 40), (5, 50)]);
}

#[test]
fn ring_operations_complete_with_their_tag() {
    let mut io = core();
    for tag in [21, 22, 23] {
        let nop = io_uring::opcode::Nop::new().build();
        // SAFETY: a no-op refers to no buffer and no file.
        unsafe { io.push_sqe(nop, task_tag(tag)) };
    }
    let mut got = drain(&mut io);
    got.sort();
    assert_eq!(got, vec![(21, 0), (22, 0), (23, 0)]);
}

/// A task that records its completions and finishes after `want` of them.
struct Recording {
    id: Arc<Mutex<Option<u32>>>,
    seen: Arc<Mutex<Vec<(u32, i32)>>>,
    want: usize,
}

impl Task for Recording {
    fn start(&mut self, _io: &mut CoreIo, id: u32) {
        *self.id.lock().unwrap() = Some(id);
    }
    fn on_complete(&mut self, _io: &mut CoreIo, slot: u32, res: i32) {
        self.seen.lock().unwrap().push((slot, res));
    }
    fn finished(&self) -> bool {
        self.seen.lock().unwrap().len() >= self.want
    }
}

#[test]
fn another_thread_completes_a_task_tag_through_the_mailbox() {
    let cfg = ReactorConfig {
        pin: false,
        exit_when_idle: true,
        ..ReactorConfig::default()
    };
    let mut reactors = spawn_reactors(&cfg).expect("reactor");
    let (mailbox, thread) = reactors.pop().expect("one core");
    let id = Arc::new(Mutex::new(None));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (i2, s2) = (id.clone(), seen.clone());
    mailbox.spawn(Box::new(move |_io: &mut CoreIo| {
        Box::new(Recording {
            id: i2,
            seen: s2,
            want: 2,
        }) as Box<dyn Task>
    }));
    let until = Instant::now() + Duration::from_secs(10);
    let task = loop {
        if let Some(t) = *id.lock().unwrap() {
            break t;
        }
        assert!(Instant::now() < until, "the task did not start");
        std::thread::sleep(Duration::from_millis(1));
    };
    mailbox.complete(Tag::task(task, 5), 42);
    mailbox.complete(Tag::task(task, 6), -3);
    // The task finishes after both: with `exit_when_idle` the reactor then returns.
    let t0 = Instant::now();
    while !thread.is_finished() {
        if t0.elapsed() > Duration::from_secs(10) {
            mailbox.send(Msg::Stop);
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    thread.join().expect("reactor thread");
    assert_eq!(*seen.lock().unwrap(), vec![(5, 42), (6, -3)]);
}

/// Defers its second step from its timer's completion; the second step completes the
/// task's tag.
struct DeferOnTimer {
    id: Cell<u32>,
    task: Cell<u32>,
}

impl Continuation for DeferOnTimer {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        self.on_done(io, parent, op, ctx, res)
    }

    fn on_done(&self, io: &mut CoreIo, _parent: Tag, _op: IoOp, ctx: u64, _res: i32) {
        match ctx {
            1 => io.defer_hook(self.id.get(), 2),
            _ => io.complete(Tag::task(self.task.get(), 0), 7),
        }
    }
}

/// A task whose only work is a timer whose continuation defers the rest.
struct TimerThenDefer {
    seen: Arc<Mutex<Vec<(u32, i32)>>>,
}

impl Task for TimerThenDefer {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        let h = Rc::new(DeferOnTimer {
            id: Cell::new(0),
            task: Cell::new(id),
        });
        let hid = io.register_hook(h.clone());
        h.id.set(hid);
        let t = io.tracked(Tag::NO_PARENT, 1, hid, 1);
        io.complete_after(Duration::from_millis(2), t, 0);
    }
    fn on_complete(&mut self, _io: &mut CoreIo, slot: u32, res: i32) {
        self.seen.lock().unwrap().push((slot, res));
    }
    fn finished(&self) -> bool {
        !self.seen.lock().unwrap().is_empty()
    }
}

/// Work deferred by a timer's continuation runs without any other event waking the
/// reactor (it used to go to sleep right after firing the timer, with the deferred work
/// stranded: a write-back request parked for the cleaner never came back).
#[test]
fn work_deferred_from_a_timer_runs_without_another_wakeup() {
    let cfg = ReactorConfig {
        pin: false,
        exit_when_idle: true,
        poll_window: Duration::ZERO,
        ..ReactorConfig::default()
    };
    let mut reactors = spawn_reactors(&cfg).expect("reactor");
    let (mailbox, thread) = reactors.pop().expect("one core");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    mailbox.spawn(Box::new(move |_io: &mut CoreIo| {
        Box::new(TimerThenDefer { seen: s2 }) as Box<dyn Task>
    }));
    let t0 = Instant::now();
    while !thread.is_finished() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let finished = thread.is_finished();
    if !finished {
        mailbox.send(Msg::Stop);
    }
    thread.join().unwrap();
    assert!(finished, "the deferred step never ran");
    assert_eq!(*seen.lock().unwrap(), vec![(0, 7)]);
}
