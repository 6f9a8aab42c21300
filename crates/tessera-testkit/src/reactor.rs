//! One reactor core in a thread of its own, for tests that drive handles the way the
//! node does; stopped and joined on drop.

use std::sync::Arc;
use std::thread::JoinHandle;

use tessera_io::{spawn_reactors, Mailbox, ReactorConfig};

pub struct ReactorThread {
    /// Where to send tasks (`Mailbox::spawn`).
    pub mailbox: Arc<Mailbox>,
    thread: Option<JoinHandle<()>>,
}

impl ReactorThread {
    /// One unpinned core with the default settings.
    pub fn start() -> ReactorThread {
        let cfg = ReactorConfig {
            cores: 1,
            pin: false,
            ..ReactorConfig::default()
        };
        let (mailbox, thread) = spawn_reactors(&cfg)
            .expect("start a reactor")
            .pop()
            .expect("one core");
        ReactorThread {
            mailbox,
            thread: Some(thread),
        }
    }
}

impl Drop for ReactorThread {
    fn drop(&mut self) {
        self.mailbox.send(tessera_io::reactor::Msg::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
