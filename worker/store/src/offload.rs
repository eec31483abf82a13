//! The accelerator's share of a layer, computed on a thread of its own so that this CPU computes
//! its share (experts in RAM, and those read from disk) at the same time: a layer split between
//! VRAM and RAM then takes the longer of the two, not their sum.
//!
//! Owns: that thread and the hand-off of one layer's device jobs to it and of their outputs back.
//! Must never: decide where an expert is computed (the accelerator's tier does), or hold a job's
//! outputs back from the caller that waits for them; a thread that cannot start or has stopped
//! means the jobs are computed on the caller's thread, with the same bits.

use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use shimmer_experts::{AccelJob, Accelerator};

/// One layer's experts held by the accelerator and the rows that chose each (`n × hidden`).
struct Task {
    layer: usize,
    experts: Vec<u32>,
    rows: Vec<Vec<f32>>,
    reply: SyncSender<Vec<Option<Vec<f32>>>>,
}

pub(crate) struct Offload {
    accelerator: Arc<dyn Accelerator>,
    tasks: Mutex<Option<Sender<Task>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// A submitted share: its outputs, in the order of its experts, once `wait` returns.
pub(crate) enum Share {
    Running(Receiver<Vec<Option<Vec<f32>>>>, usize),
    Done(Vec<Option<Vec<f32>>>),
}

impl Share {
    /// Each expert's outputs, or `None` for the caller to compute on the CPU (the accelerator
    /// declined it, or the thread is gone).
    pub(crate) fn wait(self) -> Vec<Option<Vec<f32>>> {
        match self {
            Share::Done(outputs) => outputs,
            Share::Running(reply, n) => reply.recv().unwrap_or_else(|_| vec![None; n]),
        }
    }
}

fn forward(accelerator: &dyn Accelerator, layer: usize, experts: &[u32], rows: &[Vec<f32>]) -> Vec<Option<Vec<f32>>> {
    let jobs: Vec<AccelJob<'_>> = experts.iter().zip(rows).map(|(&expert, xs)| AccelJob { expert, weights: None, rows: xs }).collect();
    accelerator.forward(layer, &jobs)
}

impl Offload {
    pub(crate) fn start(accelerator: Arc<dyn Accelerator>) -> Self {
        let (tx, rx) = channel::<Task>();
        let on_thread = accelerator.clone();
        let spawned = std::thread::Builder::new().name("accel-share".into()).spawn(move || {
            for task in rx {
                let outputs = forward(on_thread.as_ref(), task.layer, &task.experts, &task.rows);
                // The caller may have gone (an error elsewhere in its layer): nothing to do then.
                let _ = task.reply.send(outputs);
            }
        });
        let (tasks, thread) = match spawned {
            Ok(handle) => (Some(tx), Some(handle)),
            Err(e) => {
                tracing::warn!("cannot start the accelerator's thread ({e}): its share of a layer runs before the CPU's");
                (None, None)
            }
        };
        Offload { accelerator, tasks: Mutex::new(tasks), thread: Mutex::new(thread) }
    }

    /// Starts computing `experts` of `layer` over their `rows`; with `overlap` false (nothing for
    /// the CPU to do meanwhile) or no thread, computes them now on this thread.
    pub(crate) fn submit(&self, layer: usize, experts: Vec<u32>, rows: Vec<Vec<f32>>, overlap: bool) -> Share {
        if overlap {
            if let Some(tx) = self.tasks.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                let (n, (reply, answer)) = (experts.len(), sync_channel(1));
                return match tx.send(Task { layer, experts, rows, reply }) {
                    Ok(()) => Share::Running(answer, n),
                    // The thread is gone: the task came back with the error.
                    Err(failed) => Share::Done(forward(self.accelerator.as_ref(), layer, &failed.0.experts, &failed.0.rows)),
                };
            }
        }
        Share::Done(forward(self.accelerator.as_ref(), layer, &experts, &rows))
    }

    /// Ends the thread after the tasks it holds.
    pub(crate) fn stop(&self) {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(handle) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = handle.join();
        }
    }
}
