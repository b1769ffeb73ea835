-- a version-2 results database as tpbench f89ba7b wrote it (sqlite3 .dump): one run, two comm rows
BEGIN TRANSACTION;
CREATE TABLE comm (
	id INTEGER NOT NULL, 
	run_id INTEGER NOT NULL, 
	rank INTEGER NOT NULL, 
	op VARCHAR(32) NOT NULL, 
	purpose VARCHAR(32) NOT NULL, 
	count INTEGER NOT NULL, 
	bytes BIGINT NOT NULL, 
	time_s DOUBLE, 
	PRIMARY KEY (id), 
	FOREIGN KEY(run_id) REFERENCES runs (id)
);
INSERT INTO "comm" VALUES(1,1,0,'all_reduce','activation',8,4096,0.01);
INSERT INTO "comm" VALUES(2,1,1,'all_reduce','activation',8,8192,0.01);
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
INSERT INTO "measurements" VALUES(1,1,0,'step_s',0.5,'s',NULL);
CREATE TABLE meta (
	"key" VARCHAR(64) NOT NULL, 
	value VARCHAR(256) NOT NULL, 
	PRIMARY KEY ("key")
);
INSERT INTO "meta" VALUES('app','tpbench');
INSERT INTO "meta" VALUES('schema_version','2');
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
INSERT INTO "runs" VALUES(1,'0123456789abcdef','{"kind": "throughput"}','throughput','tp','megatron',2,1,0,0,2,64,4,2,256,32,2,2,'fixed','float32','pure',2,'','','OK','',NULL,'2026-01-01 00:00:00.000000','2026-01-01 00:00:05.000000','host','cpu','a cpu',2,'gloo','2.x',NULL,'abc',0,NULL,NULL,NULL,'table of rank 0');
CREATE INDEX ix_runs_config_hash ON runs (config_hash);
CREATE INDEX ix_runs_status ON runs (status);
CREATE INDEX ix_measurements_run_id ON measurements (run_id);
CREATE INDEX ix_param_errors_run_id ON param_errors (run_id);
CREATE INDEX ix_comm_run_id ON comm (run_id);
COMMIT;
