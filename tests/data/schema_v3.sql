-- a version-3 results database as tpbench 11c6f80 wrote it (sqlite3 .dump): four runs, on a CPU, on two
-- nodes of 8 A100s, an H100 emulated on fake tensors, and a FAILED one
PRAGMA foreign_keys=OFF;
BEGIN TRANSACTION;
CREATE TABLE meta (
	"key" VARCHAR(64) NOT NULL, 
	value VARCHAR(256) NOT NULL, 
	PRIMARY KEY ("key")
);
INSERT INTO meta VALUES('app','tpbench');
INSERT INTO meta VALUES('schema_version','3');
CREATE TABLE runs (
	id INTEGER NOT NULL, 
	config_hash VARCHAR(16) NOT NULL, 
	config JSON NOT NULL, 
	kind VARCHAR(16) NOT NULL, 
	mode VARCHAR(32) NOT NULL, 
	engine VARCHAR(16) NOT NULL, 
	tp INTEGER NOT NULL, 
	dp INTEGER NOT NULL, 
	sp BOOLEAN NOT NULL, 
	vp BOOLEAN NOT NULL, 
	layers INTEGER NOT NULL, 
	hidden INTEGER NOT NULL, 
	heads INTEGER NOT NULL, 
	kv_heads INTEGER NOT NULL, 
	vocab INTEGER NOT NULL, 
	seq INTEGER NOT NULL, 
	micro_batch INTEGER NOT NULL, 
	global_batch INTEGER NOT NULL, 
	batch_policy VARCHAR(16) NOT NULL, 
	dtype VARCHAR(16) NOT NULL, 
	precision VARCHAR(16) NOT NULL, 
	world_size INTEGER NOT NULL, 
	fault VARCHAR(32) NOT NULL, 
	sweep TEXT NOT NULL, 
	status VARCHAR(16) NOT NULL, 
	error TEXT NOT NULL, 
	failed_rank INTEGER, 
	started_at DATETIME NOT NULL, 
	ended_at DATETIME NOT NULL, 
	host VARCHAR(256) NOT NULL, 
	device VARCHAR(16) NOT NULL, 
	device_name VARCHAR(256) NOT NULL, 
	device_count INTEGER NOT NULL, 
	backend VARCHAR(16) NOT NULL, 
	torch_version VARCHAR(64) NOT NULL, 
	cuda_version VARCHAR(32), 
	git_commit VARCHAR(64), 
	git_dirty BOOLEAN, 
	log_dir TEXT, 
	slurm_job_id VARCHAR(32), 
	nodes TEXT, 
	text TEXT NOT NULL, 
	PRIMARY KEY (id)
);
INSERT INTO runs VALUES(1,'93fc32d94c9c44c8','{"kind": "memory", "model": {"name": "tiny", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256, "intermediate_size": null, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 32768, "tie_word_embeddings": true, "flash_attn": true, "fused_swiglu": true, "lean_rmsnorm": true}, "parallel": {"tp": 2, "dp": 1, "sp": false, "vp": false, "engine": "megatron", "sp_regather": true, "sp_gather": "region", "vocab_pad_multiple": 1, "overlap": false, "ddp_bucket_mb": 25.0, "ddp_gradient_as_bucket_view": true}, "train": {"seq_len": 32, "micro_batch": 2, "global_batch": 4, "batch": "fixed_per_rank", "dtype": "float32", "precision": "pure", "loss": "cross_entropy", "keep_output": false, "recompute": "none", "lr": 0.001, "weight_decay": 0.0, "fused_optimizer": false, "compile": false, "steps": 5, "warmup": 2, "seed": 0}, "validate": {"steps": 20, "every": 5, "lr": 0.0005, "tol_fwd": 1e-05, "tol_loss": 1e-05, "tol_grad_rel": 1e-05, "tol_param": 0.001}, "launch": {"launcher": "local", "max_parallel": 4, "slurm": {"partition": "", "account": "", "time_min": 60, "gpus_per_node": 0, "cpus_per_rank": 1, "mem_gb": 0.0, "sbatch": [], "on_preempt": "requeue", "folder": "runs/slurm"}, "device": "cpu", "backend": "gloo", "nnodes": "1", "node_rank": 0, "nproc_per_node": null, "rdzv_backend": "c10d", "rdzv_endpoint": "", "rdzv_id": "tpbench", "collective_timeout_s": 300.0, "job_timeout_s": 3600.0, "memory_cap_mb": 0, "max_result_mb": 64.0, "emulate": "none", "emulate_rank": null, "emulate_gpu": "H100"}, "db": {"url": "sqlite:///runs/tpbench.db"}, "debug": {"skip_grad_sum": [], "overlap_fault": ""}, "fault": "", "sweep": "v3"}','memory','tp','megatron',2,1,0,0,2,64,8,4,256,32,2,4,'fixed_per_rank','float32','pure',2,'','v3','OK','',NULL,'2026-12-01 10:00:00.000000','2026-12-01 10:00:07.000000','node1','cpu','AMD EPYC 9B14',2,'gloo','2.13.0',NULL,'11c6f80',0,NULL,NULL,NULL,'table of rank 0');
INSERT INTO runs VALUES(2,'4db285eb7821b2d7','{"kind": "memory", "model": {"name": "tiny", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256, "intermediate_size": null, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 32768, "tie_word_embeddings": true, "flash_attn": true, "fused_swiglu": true, "lean_rmsnorm": true}, "parallel": {"tp": 2, "dp": 1, "sp": false, "vp": false, "engine": "megatron", "sp_regather": true, "sp_gather": "region", "vocab_pad_multiple": 1, "overlap": false, "ddp_bucket_mb": 25.0, "ddp_gradient_as_bucket_view": true}, "train": {"seq_len": 32, "micro_batch": 2, "global_batch": 4, "batch": "fixed_per_rank", "dtype": "float32", "precision": "pure", "loss": "cross_entropy", "keep_output": false, "recompute": "none", "lr": 0.001, "weight_decay": 0.0, "fused_optimizer": false, "compile": false, "steps": 5, "warmup": 2, "seed": 0}, "validate": {"steps": 20, "every": 5, "lr": 0.0005, "tol_fwd": 1e-05, "tol_loss": 1e-05, "tol_grad_rel": 1e-05, "tol_param": 0.001}, "launch": {"launcher": "local", "max_parallel": 4, "slurm": {"partition": "", "account": "", "time_min": 60, "gpus_per_node": 0, "cpus_per_rank": 1, "mem_gb": 0.0, "sbatch": [], "on_preempt": "requeue", "folder": "runs/slurm"}, "device": "cuda", "backend": "nccl", "nnodes": "2", "node_rank": 0, "nproc_per_node": null, "rdzv_backend": "c10d", "rdzv_endpoint": "", "rdzv_id": "tpbench", "collective_timeout_s": 300.0, "job_timeout_s": 3600.0, "memory_cap_mb": 0, "max_result_mb": 64.0, "emulate": "none", "emulate_rank": null, "emulate_gpu": "H100"}, "db": {"url": "sqlite:///runs/tpbench.db"}, "debug": {"skip_grad_sum": [], "overlap_fault": ""}, "fault": "", "sweep": "v3"}','memory','tp','megatron',2,1,0,0,2,64,8,4,256,32,2,4,'fixed_per_rank','float32','pure',2,'','v3','OK','',NULL,'2026-12-01 10:00:00.000000','2026-12-01 10:00:07.000000','node1','cuda','NVIDIA A100-SXM4-80GB',8,'nccl','2.13.0','12.8','11c6f80',0,NULL,NULL,NULL,'table of rank 0');
INSERT INTO runs VALUES(3,'4458f1324f050aeb','{"kind": "memory", "model": {"name": "tiny", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256, "intermediate_size": null, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 32768, "tie_word_embeddings": true, "flash_attn": true, "fused_swiglu": true, "lean_rmsnorm": true}, "parallel": {"tp": 2, "dp": 1, "sp": false, "vp": false, "engine": "megatron", "sp_regather": true, "sp_gather": "region", "vocab_pad_multiple": 1, "overlap": false, "ddp_bucket_mb": 25.0, "ddp_gradient_as_bucket_view": true}, "train": {"seq_len": 32, "micro_batch": 2, "global_batch": 4, "batch": "fixed_per_rank", "dtype": "float32", "precision": "pure", "loss": "cross_entropy", "keep_output": false, "recompute": "none", "lr": 0.001, "weight_decay": 0.0, "fused_optimizer": false, "compile": false, "steps": 5, "warmup": 2, "seed": 0}, "validate": {"steps": 20, "every": 5, "lr": 0.0005, "tol_fwd": 1e-05, "tol_loss": 1e-05, "tol_grad_rel": 1e-05, "tol_param": 0.001}, "launch": {"launcher": "local", "max_parallel": 4, "slurm": {"partition": "", "account": "", "time_min": 60, "gpus_per_node": 0, "cpus_per_rank": 1, "mem_gb": 0.0, "sbatch": [], "on_preempt": "requeue", "folder": "runs/slurm"}, "device": "cuda", "backend": "nccl", "nnodes": "1", "node_rank": 0, "nproc_per_node": null, "rdzv_backend": "c10d", "rdzv_endpoint": "", "rdzv_id": "tpbench", "collective_timeout_s": 300.0, "job_timeout_s": 3600.0, "memory_cap_mb": 0, "max_result_mb": 64.0, "emulate": "fake", "emulate_rank": null, "emulate_gpu": "H100"}, "db": {"url": "sqlite:///runs/tpbench.db"}, "debug": {"skip_grad_sum": [], "overlap_fault": ""}, "fault": "", "sweep": "v3"}','memory','tp','megatron',2,1,0,0,2,64,8,4,256,32,2,4,'fixed_per_rank','float32','pure',2,'','v3','OK','',NULL,'2026-12-01 10:00:00.000000','2026-12-01 10:00:07.000000','node1','cuda','H100 (emulated on AMD EPYC 9B14)',2,'fake','2.13.0','12.8','11c6f80',0,NULL,NULL,NULL,'table of rank 0');
INSERT INTO runs VALUES(4,'c05a10d27d9e7faa','{"kind": "validate", "model": {"name": "tiny", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256, "intermediate_size": null, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 32768, "tie_word_embeddings": true, "flash_attn": true, "fused_swiglu": true, "lean_rmsnorm": true}, "parallel": {"tp": 2, "dp": 1, "sp": false, "vp": false, "engine": "megatron", "sp_regather": true, "sp_gather": "region", "vocab_pad_multiple": 1, "overlap": false, "ddp_bucket_mb": 25.0, "ddp_gradient_as_bucket_view": true}, "train": {"seq_len": 32, "micro_batch": 2, "global_batch": 4, "batch": "fixed_per_rank", "dtype": "float32", "precision": "pure", "loss": "cross_entropy", "keep_output": false, "recompute": "none", "lr": 0.001, "weight_decay": 0.0, "fused_optimizer": false, "compile": false, "steps": 5, "warmup": 2, "seed": 0}, "validate": {"steps": 20, "every": 5, "lr": 0.0005, "tol_fwd": 1e-05, "tol_loss": 1e-05, "tol_grad_rel": 1e-05, "tol_param": 0.001}, "launch": {"launcher": "local", "max_parallel": 4, "slurm": {"partition": "", "account": "", "time_min": 60, "gpus_per_node": 0, "cpus_per_rank": 1, "mem_gb": 0.0, "sbatch": [], "on_preempt": "requeue", "folder": "runs/slurm"}, "device": "cpu", "backend": "gloo", "nnodes": "1", "node_rank": 0, "nproc_per_node": null, "rdzv_backend": "c10d", "rdzv_endpoint": "", "rdzv_id": "tpbench", "collective_timeout_s": 300.0, "job_timeout_s": 3600.0, "memory_cap_mb": 0, "max_result_mb": 64.0, "emulate": "none", "emulate_rank": null, "emulate_gpu": "H100"}, "db": {"url": "sqlite:///runs/tpbench.db"}, "debug": {"skip_grad_sum": [], "overlap_fault": ""}, "fault": "", "sweep": "v3"}','validate','tp','megatron',2,1,0,0,2,64,8,4,256,32,2,4,'fixed_per_rank','float32','pure',2,'','v3','FAILED','rank 1: RuntimeError: boom',1,'2026-12-01 10:00:00.000000','2026-12-01 10:00:07.000000','node1','cpu','AMD EPYC 9B14',2,'gloo','2.13.0',NULL,'11c6f80',0,NULL,NULL,NULL,'');
CREATE TABLE measurements (
	id INTEGER NOT NULL, 
	run_id INTEGER NOT NULL, 
	rank INTEGER NOT NULL, 
	name VARCHAR(64) NOT NULL, 
	value DOUBLE NOT NULL, 
	unit VARCHAR(16) NOT NULL, 
	step INTEGER, 
	PRIMARY KEY (id), 
	FOREIGN KEY(run_id) REFERENCES runs (id)
);
INSERT INTO measurements VALUES(1,1,0,'peak_bytes',1000.0,'B',NULL);
INSERT INTO measurements VALUES(2,1,0,'passed',1.0,'',NULL);
INSERT INTO measurements VALUES(3,1,0,'adamw_logits_max_abs',9.9999999999999995472e-07,'',1);
INSERT INTO measurements VALUES(4,1,1,'peak_bytes',1001.0,'B',NULL);
INSERT INTO measurements VALUES(5,1,1,'passed',1.0,'',NULL);
INSERT INTO measurements VALUES(6,1,1,'adamw_logits_max_abs',9.9999999999999995472e-07,'',1);
INSERT INTO measurements VALUES(7,2,0,'peak_bytes',2000.0,'B',NULL);
INSERT INTO measurements VALUES(8,2,0,'passed',1.0,'',NULL);
INSERT INTO measurements VALUES(9,2,0,'adamw_logits_max_abs',9.9999999999999995472e-07,'',1);
INSERT INTO measurements VALUES(10,2,1,'peak_bytes',2001.0,'B',NULL);
INSERT INTO measurements VALUES(11,2,1,'passed',1.0,'',NULL);
INSERT INTO measurements VALUES(12,2,1,'adamw_logits_max_abs',9.9999999999999995472e-07,'',1);
INSERT INTO measurements VALUES(13,3,0,'peak_bytes',3000.0,'B',NULL);
INSERT INTO measurements VALUES(14,3,0,'passed',1.0,'',NULL);
INSERT INTO measurements VALUES(15,3,0,'adamw_logits_max_abs',9.9999999999999995472e-07,'',1);
INSERT INTO measurements VALUES(16,3,1,'peak_bytes',3001.0,'B',NULL);
INSERT INTO measurements VALUES(17,3,1,'passed',1.0,'',NULL);
INSERT INTO measurements VALUES(18,3,1,'adamw_logits_max_abs',9.9999999999999995472e-07,'',1);
CREATE TABLE param_errors (
	id INTEGER NOT NULL, 
	run_id INTEGER NOT NULL, 
	rank INTEGER NOT NULL, 
	name VARCHAR(256) NOT NULL, 
	semantics VARCHAR(32) NOT NULL, 
	shape VARCHAR(64) NOT NULL, 
	grad_mean_abs DOUBLE NOT NULL, 
	grad_max_abs DOUBLE NOT NULL, 
	grad_rel_l2 DOUBLE NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(run_id) REFERENCES runs (id)
);
INSERT INTO param_errors VALUES(1,1,0,'model.norm.weight','replicated','[64]',1.0000000000000000622e-09,2.0000000000000001244e-09,2.9999999999999998642e-07);
INSERT INTO param_errors VALUES(2,1,1,'model.norm.weight','replicated','[64]',1.0000000000000000622e-09,2.0000000000000001244e-09,2.9999999999999998642e-07);
INSERT INTO param_errors VALUES(3,2,0,'model.norm.weight','replicated','[64]',1.0000000000000000622e-09,2.0000000000000001244e-09,2.9999999999999998642e-07);
INSERT INTO param_errors VALUES(4,2,1,'model.norm.weight','replicated','[64]',1.0000000000000000622e-09,2.0000000000000001244e-09,2.9999999999999998642e-07);
INSERT INTO param_errors VALUES(5,3,0,'model.norm.weight','replicated','[64]',1.0000000000000000622e-09,2.0000000000000001244e-09,2.9999999999999998642e-07);
INSERT INTO param_errors VALUES(6,3,1,'model.norm.weight','replicated','[64]',1.0000000000000000622e-09,2.0000000000000001244e-09,2.9999999999999998642e-07);
CREATE TABLE comm (
	id INTEGER NOT NULL, 
	run_id INTEGER NOT NULL, 
	rank INTEGER NOT NULL, 
	op VARCHAR(32) NOT NULL, 
	purpose VARCHAR(32) NOT NULL, 
	count INTEGER NOT NULL, 
	bytes BIGINT NOT NULL, 
	time_s DOUBLE, 
	exposed_s DOUBLE, 
	PRIMARY KEY (id), 
	FOREIGN KEY(run_id) REFERENCES runs (id)
);
INSERT INTO comm VALUES(1,1,0,'all_reduce','activation',8,4096,0.010000000000000000208,0.005000000000000000104);
INSERT INTO comm VALUES(2,1,1,'all_reduce','activation',8,8192,0.010000000000000000208,0.005000000000000000104);
INSERT INTO comm VALUES(3,2,0,'all_reduce','activation',8,4096,0.010000000000000000208,0.005000000000000000104);
INSERT INTO comm VALUES(4,2,1,'all_reduce','activation',8,8192,0.010000000000000000208,0.005000000000000000104);
INSERT INTO comm VALUES(5,3,0,'all_reduce','activation',8,4096,0.010000000000000000208,0.005000000000000000104);
INSERT INTO comm VALUES(6,3,1,'all_reduce','activation',8,8192,0.010000000000000000208,0.005000000000000000104);
CREATE INDEX ix_runs_status ON runs (status);
CREATE INDEX ix_runs_config_hash ON runs (config_hash);
CREATE INDEX ix_measurements_run_id ON measurements (run_id);
CREATE INDEX ix_param_errors_run_id ON param_errors (run_id);
CREATE INDEX ix_comm_run_id ON comm (run_id);
COMMIT;
